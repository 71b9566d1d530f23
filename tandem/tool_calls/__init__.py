"""Tool calling: the tool-call parsers (hermes, llama3_json, mistral, pythonic, and the JSON
of `tool_choice="required"` or a named function), their streaming, and what `tools` and
`tool_choice` ask of the prompt and the grammar."""
