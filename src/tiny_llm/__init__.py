"""tiny_llm: your solution to the course, a Qwen2 model and its serving path from mlx.core operations.

Modules are imported by name (`tiny_llm.attention`, `tiny_llm.qwen2_week1`, ...); this file
imports none of them, so the test harness can swap any one module for the reference's.
"""
