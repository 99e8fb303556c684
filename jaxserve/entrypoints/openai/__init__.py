"""The OpenAI-compatible API: ``protocol`` (request bodies -> SamplingParams, response bodies),
``serving`` (framework-independent handlers), ``api_server`` (the FastAPI app, ``jaxserve serve``).
"""
