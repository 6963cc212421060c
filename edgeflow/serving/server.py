"""Edge server: an OpenAI-compatible HTTP API in front of one compiled edgeflow engine.

    python -m edgeflow.serving.server --engine engines/cpu --host 127.0.0.1 --port 8000

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming SSE and not),
GET /v1/models, GET /health (deep probe: one real token through the engine), GET /ready,
GET /metrics (Prometheus), GET / (a chat page), POST /feedback (the page's feedback buttons).

This module is only the entry point. Where each concern lives: edgeflow.serving.app (settings, routes, CLI),
edgeflow.serving.protocol (schemas, errors, request bodies), edgeflow.serving.admission (queue, deadline), edgeflow.serving.metrics,
edgeflow.serving.runtime (engine, generations), edgeflow.serving.generation (the request path both generation endpoints
share), edgeflow.serving.chat, edgeflow.serving.completions, edgeflow.serving.models, edgeflow.serving.probes (/health, /ready, /metrics),
edgeflow.serving.feedback, edgeflow.serving.page (the chat page), edgeflow.serving.state (what the handlers share).

Design notes (the why):

* Hardware-agnostic. The server only calls the engine interface of `edgeflow.engines`
  (`check_compatible`, `load`, `generate`, the device hooks) on the backend named in the settings; it
  never looks at the device. `engine.json` (edgeflow.engines.engine_dir) says which backend built it, and the tokenizer
  and chat template are read from the same dir, so what is served is exactly what was built.
* Sampling: `temperature`, `top_p`, `top_k`, `seed`, `stop`, `frequency_penalty`, `presence_penalty`,
  `repetition_penalty`, `logprobs`/`top_logprobs` go to the engine as one `SamplingParams`
  (edgeflow.engines.sampling); where the request is silent the engine's generation_config.json decides,
  and where that is silent too decoding is greedy (what the consistency gate measured). A parameter the
  engine's backend cannot honour gets 400 naming it and the backend, never silent greedy decoding.
  `n` must be 1. Any unknown field is rejected (422) rather than silently ignored.
* API keys (edgeflow.serving.auth): with a key configured, /v1/* and /feedback answer 401 without it (and the
  probes too with `auth_probes`).
* Engine calls block, so each generation runs in a worker thread of one executor with
  `max_concurrency + 1` threads: `max_concurrency` for requests, one kept free for /health and
  the warm-up so a busy server still answers its probes. A request beyond `max_concurrency`
  waits in a queue of at most `max_queue`; beyond that it gets 429 + Retry-After at once
  (shedding load early beats letting every client time out).
* A slot is released when the worker thread has really stopped, not when the client leaves:
  the concurrency bound is about CPU/GPU work, and a cancelled generation stops at its next token.
* Every generation has a deadline (`request_timeout_s`, counted from arrival, queueing included).
  Past it the client gets 504, or an SSE error event if the stream already started; a connection
  is never left open silently.
* Streaming text, stop strings and logprobs come from edgeflow.serving.decoding; the non-streaming answer is
  the concatenation of the very same pieces, so both modes return identical text.
* Status codes recorded for streams that already answered 200 describe the outcome: 499 client
  went away, 504 deadline, 500 engine error (the nginx/OpenAI conventions).
* A watchdog thread (edgeflow.serving.watchdog) ends the process when an engine call makes no progress for
  `watchdog_stall_s`, after failing /health and sending an error event to every open stream; run the
  server under edgeflow.serving.supervisor (deploy-edge does) or systemd to get it restarted.
* Chat requests keep the last `history_turns` turns; older ones are condensed into one summary
  line (edgeflow.serving.conversation), so a long chat stays under max_prompt_tokens.
"""
from __future__ import annotations

import sys

from edgeflow.serving.app import main

if __name__ == "__main__":
    sys.exit(main())
