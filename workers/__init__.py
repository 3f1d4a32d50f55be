"""Workers: turn prompts into generations with an inference engine."""
