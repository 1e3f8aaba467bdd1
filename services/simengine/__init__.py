"""The simulated engine (`motor engine-sim`): a vLLM/SGLang-compatible HTTP server without a model.

Business port (`--host`/`--port`, default 127.0.0.1:10000; `--port 0` binds an ephemeral port and
the real one is logged as `event=listening service=engine-sim http=H:P [bootstrap=H:B]`):
  POST /v1/chat/completions, /v1/completions   OpenAI, stream or not, usage, logprobs, and vLLM
                                               0.32's return_token_ids, prompts as token ids
                                               (a completion's `prompt`, a chat's
                                               `kv_transfer_params.prompt_token_ids`),
                                               continue_final_message, echo (chat)
  GET  /v1/models, /health, /health_generate, /metrics, /get_model_info, /get_server_info, /version
                                               (/v1/models: each model's `max_model_len`)
  POST /flush_cache, /reset_prefix_cache       empty the prefix cache (SGLang's and vLLM's names)
  GET|POST /sim/fault                          fault injection, loopback clients only

PD hand-off:
  vLLM   request `kv_transfer_params.do_remote_decode: true` -> prefill leg (1 token); the answer
         carries top-level `kv_transfer_params` {do_remote_prefill: true, do_remote_decode: false,
         remote_engine_id, remote_block_ids, remote_host, remote_port, remote_request_id, tp_size};
         sending those back (do_remote_prefill: true) makes a decode leg.
  SGLang request `bootstrap_host`, `bootstrap_port`, `bootstrap_room`; a prefill-role engine
         registers the room on its bootstrap port, a decode-role engine long-polls
         `GET http://bootstrap_host:bootstrap_port/room/{room}?timeout_s=T` (see pd.py); with
         SGLang's fake host `2.2.2.2` (warm-up, the NodeManager's inference probe) either role
         serves the request alone.

Prefix cache (prefix_cache.py): a prompt's full `--block-size` blocks (default 16) are cached,
LRU, up to `--num-gpu-blocks-override` blocks (default 65536); a cached prefix is not prefilled
again (`--prefill-ms-per-token` counts only the uncached tokens). On by default as in vLLM V1;
`--no-enable-prefix-caching` turns it off. Prompts are tokenized by `--tokenizer` (a
tokenizer.json or a directory with one; default the model's directory), else one token per
whitespace-separated word; metrics vllm:prefix_cache_queries/hits (tokens). A chat is the
model's chat template (its tokenizer_config.json beside the tokenizer.json) rendered as vLLM
renders it and encoded without special tokens, so its ids and KV blocks are a real vLLM's;
without a template, one `<role>: <text>` line per message (tokens.py, openai_api.py).
KV events (kv_events.py): `--kv-events-config` (vLLM's JSON) publishes every cache change on
vLLM's ZMQ wire (PUB `endpoint`, replay ROUTER `replay_endpoint`, ports + data-parallel rank),
sent after the answer that caused them, as vLLM's publisher thread does; the bound addresses
are logged in the listening line (`kv_events=`, `kv_replay=`).

Latency (latency.py, docs/sim-engine.md): first token after `--ttft-ms` + `--prefill-ms-per-token`
per uncached prompt token (a decode leg's: `--kv-transfer-ms`), then `--tpot-ms` per token, at most
`--max-num-seqs` running; opt-in load dependence: `--prefill-compute serial` (prefills take one
compute in turn) and `--tpot-ms-per-seq X` (each token + X ms per other running sequence).

Context (`--max-model-len N`, SGLang's `--context-length`; default 131072): a request whose
prompt has N tokens or more, or whose `max_tokens` would run past N, is a 400 in vLLM's words; a
`max_tokens` not given is cut to what the context leaves.

Answers (generation.py, docs/sim-engine.md): greedy, each token a function of the whole token
context before it, so a prompt resent with the first k tokens of its answer appended continues
that answer exactly (what a router does when an engine died mid-stream); the `die_after_tokens`
fault (`--fault-after-tokens N`) is that death: a SIGKILL after N output tokens.

Tracing: with `--otlp-traces-endpoint URL` (vLLM's flag) or OTEL_EXPORTER_OTLP_ENDPOINT, one
`llm_request` span per completion request, child of its `traceparent` (docs/tracing.md).

Modules: cli (argv), server (process runtime: uvloop, motor_mesh.common.httpserver), app (routes),
completion (the completion routes), openai_api (bodies), generation (deterministic text), latency,
faults, pd, metrics, tokens (prompt token ids), prefix_cache, kv_events, tracing (spans, loaded
only when on), worker (child processes).
"""
