"""Built-in harnesses: the generic tool-calling loop and the bash ReAct loop for software tasks."""
