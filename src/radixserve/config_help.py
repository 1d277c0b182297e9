"""The help text of every option (the ``--flag`` help of ``radixserve serve`` and ``generate``)."""

from __future__ import annotations

FIELD_HELP: dict[str, str] = {
    # engine
    "model": "model name (smollm2-135m, gemma3-270m; tiny-random, tiny-random-gemma3 and tiny-random-llava for tests) or path to a .gguf file or a Hugging Face folder",
    "cache": "prefix cache: radix (RadixAttention), table (flat ablation) or none",
    "policy": "scheduling order of waiting requests: lpm (longest prefix match), dfs-weight, fcfs, random",
    "dtype": "weights dtype: float32, bfloat16, or auto (by CPU features, never a timing: bfloat16 where "
             "the vector kernels run, float32 on the portable path; the choice and why are logged and in "
             "/server_info)",
    "device": "torch device for weights and the KV pool (cpu, cuda, ...)",
    "attention_backend": "attention implementation: torch (fused CPU kernels when they build, else eager) "
                         "or torch-eager (the reference path)",
    "cpu_isa": "highest instruction set the CPU kernels may use: generic (portable C++), avx2, avx512, amx "
               "(AMX-BF16 tiles for prefill, where a startup probe admits them), or "
               "auto ($RADIXSERVE_CPU_ISA if set, else the best this CPU has); lower levels run and test the "
               "paths of lesser CPUs",
    "linear_backend": "how the linear layers run: radixserve (the kernels' packed GEMM, batch-invariant: "
                      "float32 fma chains for a float32 model, bfloat16 dot products for a bfloat16 one), "
                      "onednn (torch's oneDNN on reordered weights; NOT batch-invariant: a request's "
                      "output depends on what else is in its batch), torch (F.linear; NOT batch-invariant "
                      "on CPU), or auto (radixserve wherever the kernels build)",
    "weight_dtype": "how the linear weights are held: gguf (a GGUF's quantized blocks as shipped, computed "
                    "directly: the same tokens and logprobs as the dense bfloat16 model of that file, at a "
                    "quarter to a half of its bytes per decode step), gguf-q8 (the same blocks computed with "
                    "integer dot products against activations quantized to 8 bits per 32-block, as llama.cpp "
                    "does: Q8_0, Q4_0 and Q4_1 tensors, other formats as with gguf; exact to its own stated "
                    "definition, batch-invariant, not the dense model's bits), gguf-codes (the same formats computed "
                    "on their integer codes with the bfloat16 activations, the scale applied once per block: "
                    "exact to its own stated definition, batch-invariant, near the dense model's bits), int8 (per-output-channel int8, "
                    "weight-only, from any source), dense (every weight in --dtype), or auto (for a GGUF served "
                    "in bfloat16 on the kernels with native bfloat16 dot products: its Q4_0 and Q8_0 "
                    "tensors as gguf-codes, its other blocks as gguf; else dense; by CPU features and the "
                    "file, never a timing: the choice and why are logged and in /server_info)",
    "page_size": "tokens per KV page; the cache matches and stores whole pages",
    "kv_cache_tokens": "KV pool capacity in tokens, shared by the cache and running requests",
    "kv_cache_dtype": "KV pool storage: auto (the weights' dtype), float32, bfloat16, or int8 / fp8_e4m3 "
                      "(one float32 scale per token and KV head, written with the K/V: no calibration)",
    "swa_kv_cache_tokens": "models with sliding-window layers: their KV pool in tokens, beside the "
                           "full-attention one (0 = auto: a window per running request, at least a quarter "
                           "of kv_cache_tokens)",
    "hybrid_kv": "models with sliding-window layers: a KV pool per kind, sliding-window KV kept only "
                 "where a window reads it (off: every layer's KV for every cached token, the "
                 "full-attention layout)",
    "mamba_snapshots": "models with Mamba layers: state snapshots the prefix cache keeps (a prefix is "
                       "reused only up to its deepest snapshot); 0 = auto (max_running_requests)",
    "mamba_snapshot_interval": "models with Mamba layers: also snapshot the state at every multiple of this "
                               "many tokens inside a prompt being prefilled (its chunks are cut there), so a "
                               "later prompt sharing only part of a long one resumes near where they part; "
                               "these snapshots count against --mamba-snapshots; 0 = off (snapshots at request "
                               "ends and branch points only)",
    "max_running_requests": "most requests decoding at once",
    "max_prefill_tokens": "most new prompt tokens computed in one step",
    "chunked_prefill_size": "longer prompts are prefilled in chunks of this many tokens",
    "max_context_len": "longest prompt + output in tokens (0 = the model's context length)",
    "mixed_steps": "run decode tokens and a prefill chunk in the same step",
    "lpm_fallback_queue_len": "above this many waiting requests, lpm falls back to fcfs",
    "lpm_max_wait_s": "lpm: a request waiting longer than this goes ahead of longer matches",
    "lpm_max_passes": "lpm: a request passed over by this many later arrivals goes ahead",
    "decode_reserve_ratio": "share of each request's max_tokens reserved at admission",
    "decode_reserve_clip": "a request's decode reservation is at most this many tokens",
    "in_batch_sharing": "run one of several requests sharing an uncached prefix first",
    "in_batch_sharing_min_tokens": "shortest shared uncached prefix that makes a request wait a step",
    "session_ttl_s": "requests with a session id keep their conversation's cached KV (for a sliding-window "
                     "model: its window) locked until the session's next turn, its close, or this many "
                     "seconds without a request (0 = sessions off); under memory pressure sessions yield",
    "max_sessions": "most sessions holding KV at once; a new one ends the least recently used",
    "seed": "seed for requests without their own seed",
    "grammar_fast_forward": "structured outputs: compute the tokens a grammar forces in one step "
                            "(same output as one token per step)",
    "speculative": "speculative decoding: ngram-tree drafts each decoding request's next tokens from "
                   "what followed its last few tokens in the radix tree of its tenant (every prompt "
                   "and answer the server holds) or earlier in its own output, and verifies them in "
                   "the same step; the same tokens and logprobs as without it (seeded sampling "
                   "included), a request whose drafts miss backs off; needs --cache radix, no "
                   "HiCache tiers, one rank per core (--dp is fine, --tp is not), and the batch-invariant "
                   "kernels; none = off",
    "num_draft_tokens": "speculative decoding: most draft tokens a request verifies in one step "
                        "(adapted per request to what it gets accepted)",
    "speculative_min_ngram": "speculative decoding: shortest suffix of a request's tokens looked up "
                             "as a draft's context",
    "speculative_max_ngram": "speculative decoding: longest suffix looked up (the longest found wins)",
    "speculative_row_cost": "speculative decoding: what one more row costs a decode step, as a share of "
                            "the step's fixed cost (a pass over the weights): the price of a draft "
                            "token's row where --speculative-pricing has not measured steps of that many "
                            "rows yet (0 = rows are free). Draft tokens are verified only while their "
                            "expected acceptance pays for their rows, so big batches draft less",
    "speculative_pricing": "speculative decoding: row-cost prices draft rows by the row cost alone (the same "
                           "drafts on every run); measured by the decode step CPU times this engine measures "
                           "per row count (the row cost as the prior). Outputs are the same either way",
    "image_content_keys": "images: key image tokens by a hash of the pixels, so the same image in "
                          "another request hits (off: image tokens are never shared)",
    "image_cache_bytes": "images: bytes of vision-encoder outputs kept by image hash (0 = off)",
    "num_threads": "torch CPU threads for the model (0 = one per core)",
    "thread_policy": "adaptive: run a step on fewer threads while other processes use the cores "
                     "(spinning threads that wait on a descheduled sibling make a step many times "
                     "slower; the results are the same bits on any thread count); fixed: always "
                     "--num-threads",
    "kv_events_endpoint": "ZMQ endpoint where the engine publishes its cache events (for a router); "
                          "empty = off",
    "hicache_l2_tokens": "HiCache: host-memory (L2) tier below the KV pool, in tokens (0 = off)",
    "hicache_storage": "HiCache: shared storage (L3) below L2: file:///path or redis://host:port/db",
    "hicache_write_policy": "HiCache: when KV is copied down to L2: write_through, write_through_selective "
                            "(after --hicache-write-through-threshold hits) or write_back (on eviction)",
    "hicache_write_through_threshold": "HiCache: hits before write_through_selective copies a run to L2",
    "hicache_prefetch_policy": "HiCache: a request whose prefix is in L3 waits for the fetch: best_effort "
                               "(not at all), wait_complete, or timeout",
    "hicache_prefetch_timeout_s": "HiCache: longest wait for an L3 prefetch (timeout policy)",
    "hicache_storage_page_tokens": "HiCache: tokens per storage object (L3 page), a multiple of "
                                   "page_size; a prefix shorter than one is never stored",
    "hicache_prefetch_min_tokens": "HiCache: skip a prefetch when storage could add fewer tokens than this",
    "hicache_write_queue_pages": "HiCache: pages waiting to be written to L3 before new ones are dropped "
                                 "(and counted)",
    "hicache_storage_timeout_s": "HiCache: socket timeout of one storage call (Redis)",
    "hicache_storage_retry_s": "HiCache: after a failed storage call, storage is skipped this long",
    "hicache_ghost_entries": "HiCache: evicted prefixes remembered to tell 'evicted' from 'never seen' in "
                             "miss telemetry",
    "tp_size": "tensor parallelism: ranks the model is sharded over (heads, MLP, vocabulary); rank 0 "
               "schedules and samples, the others run its steps on their shards",
    "nnodes": "tensor parallelism over several machines: how many (tp_size ranks split evenly)",
    "node_rank": "this machine's index among nnodes; node 0 serves HTTP and runs rank 0, the others "
                 "run only their worker ranks",
    "dist_init_addr": "HOST:PORT where rank 0 listens for the other ranks (needed with nnodes > 1; "
                      "default: loopback, any free port)",
    "dist_timeout_s": "tensor parallelism: longest wait in a collective or for a rank to start",
    # server
    "host": "address to bind",
    "port": "port to bind; 0 picks a free one",
    "api_key": "require 'Authorization: Bearer KEY'; repeat for several keys, as KEY or KEY:TENANT",
    "api_key_file": "file of API keys, one 'KEY[:TENANT]' per line ('#' comments)",
    "admin_key": "key for admin routes (/flush_cache, /abort_request of any request, /metrics)",
    "served_model_name": "model name reported by the API (default: --model)",
    "chat_template": "chat template of /v1/chat/completions, a Jinja file or the template text, in place "
                     "of the model's; a model that ships none (a base model) answers chat requests with "
                     "400 unless one is given",
    "log_level": "log level",
    "log_requests": "log prompt text of each request (off: only sizes and timings)",
    "hide_cached_tokens": "always report 0 cached tokens (no cache side channel at all)",
    "core_in_process": "run the engine core on a thread of the API process instead of its own process",
    "dp": "data parallelism: engine-core processes behind this server, each with its own cache and "
          "KV pool (kv_cache_tokens each) and an equal share of the threads; requests go to the core "
          "whose cache holds most of their prompt, given the queues",
    "dp_policy": "how requests are spread over the dp cores: cache_aware, round_robin, shortest_queue, "
                 "prefix_hash or random",
    "max_body_bytes": "largest request body accepted (413 above; base64 images count at 4/3 their size)",
    "body_read_timeout_s": "time a client has to send a request's whole body once its headers are in "
                           "(408 and the connection closed after it: a body announced and never sent "
                           "would hold the connection forever)",
    "max_images_per_request": "images: most images in one request (400 above)",
    "max_image_bytes": "images: largest encoded image, after base64 decoding or fetching (400 above)",
    "max_image_pixels": "images: most pixels in one image, checked before decoding (400 above)",
    "allow_image_urls": "images: fetch http(s) image URLs (off: data URIs and base64 only), from public "
                        "addresses only (every address the host resolves to, and each redirect's, is "
                        "checked; no proxy)",
    "allow_private_image_urls": "images: let image URLs reach loopback, private, link-local and other "
                                "non-public addresses too (the server then fetches from its own network "
                                "whatever a client names)",
    "image_url_timeout_s": "images: time limit for fetching one image URL",
    "image_url_max_redirects": "images: most redirects followed when fetching an image URL",
    "max_prompt_chars": "longest prompt or message text, in characters, checked before tokenizing",
    "max_prompts_per_request": "most prompts in one request",
    "max_choices_per_request": "most choices (n x prompts) in one request",
    "max_stop_strings": "most stop strings per request",
    "max_stop_string_chars": "longest stop string",
    "max_stop_token_ids": "most stop token ids per request",
    "max_queued_requests": "requests waiting beyond the running ones before new ones get 429",
    "startup_timeout_s": "seconds to wait for the engine core to load the model",
}
