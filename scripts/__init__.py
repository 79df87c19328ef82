"""The commands a student runs (`pdm run main`, `test`, `compare`, `grade`, ...): see pyproject.toml.

The teaching packages (`tiny_llm`, `tiny_llm_ref`) never import from here.
"""
