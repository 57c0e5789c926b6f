"""The runner's side of KV connectors: the host-memory tier's copies (host_kv_store.py) and a disaggregated
prefill's hand-off of finished prompts' KV (kv_handoff.py). The scheduler's side is in gemmaserve/kv/."""
