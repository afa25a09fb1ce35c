"""``tailserve router``: an OpenAI-compatible proxy in front of several ``tailserve serve`` or vLLM
servers, choosing a backend per request with the cluster simulator's routing code."""
