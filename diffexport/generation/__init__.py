"""The generation API: text generation with a decoder folder (`text_generation`), its chat template
rendered within bounds (`chat_template`) and prompts files (`prompts`). Nothing is imported here."""
