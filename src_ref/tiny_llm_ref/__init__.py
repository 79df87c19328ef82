"""tiny_llm_ref: the reference solution of the course, a Qwen2 model and its serving path from mlx.core operations.

Modules are imported by name (`tiny_llm_ref.attention`, `tiny_llm_ref.qwen2_week1`, ...); this file
imports none of them, so the test harness can swap any one module for a student's.
"""
