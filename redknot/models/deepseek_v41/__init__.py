"""DeepSeek-V4.1-Flash (``DeepseekV41ForCausalLM``): the model family of reference
``deepseek_v41.md``.

Torch-free parts (``mode=catalog`` and the config checks use them): ``config`` (+
``config_parse``: the released nested config.json and the flat reference names, the
derived per-layer schedule), ``engram_hash`` (primes, multipliers; its tensor hasher
imports torch lazily), ``token_map`` (the Engram token map of a tokenizer.json),
``checkpoint`` (the native tensor schema), ``census`` (parameters and bytes by
component), ``cost`` (FLOPs and bytes, the per-GPU memory plan and its fit check),
``state_layout`` and ``family``.

``weights`` / ``writer`` read and write the native safetensors layout (FP8 32x32 tiles,
MXFP4 experts, FP8 Engram tables); ``reference`` is the one-shot dense oracle and
``model`` (with ``attention``, ``moe``, ``mhc``, ``engram``, ``state``) the engine path.
"""
