"""The PII planted in the sample access log (data/access_logs), listed apart from the scrubber that must remove it."""

# A second, independent list: literal fragments of the PII planted in the sample log (see its README).
PLANTED = ["@example.com", "@example.org", "555-0132", "555-0199", "7946 0958", "4111 1111", "sk-", "ghp_", "eyJ", "-45-6789"]
