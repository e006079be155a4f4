"""Pure conversions: Responses request -> chat body, the vLLM boundary rewrite, chat reply -> Response."""
