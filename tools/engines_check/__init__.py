"""Check Motor's engine launch lines against the real vLLM and SGLang argument handling.

``cases`` builds every launch a realistic cluster gets (Motor's own config loader, assembly
plan and launch functions) and ``invariants`` checks the cross-process facts no single engine
can see; ``vllm_side`` and ``sglang_side`` run inside each engine's own venv and feed every
launch line through that engine's parser and config resolution. ``python -m tools.engines_check`` drives
both (``make engines-check``).
"""
