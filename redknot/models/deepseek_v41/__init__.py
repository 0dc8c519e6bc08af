"""DeepSeek-V4.1-Flash (``DeepseekV41ForCausalLM``): the model family of reference
``deepseek_v41.md``.

Torch-free parts: ``config`` (+ ``config_parse``), ``engram_hash`` (primes,
multipliers; its tensor hasher imports torch lazily), ``token_map``, ``checkpoint``
(the native tensor schema), ``cost`` and ``census``. ``weights`` / ``writer`` read
and write the native safetensors layout; the forward pass lives in ``model``.
"""
