"""Helpers the tests share: ports, live servers, tiny model families, sampling statistics, the end-to-end runs, and
the tracking fixtures (a real MLflow server; releases recorded as the stages record them). Test files import from
here, never from each other."""
