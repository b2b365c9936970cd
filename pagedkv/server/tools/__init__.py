"""Tool calling and reasoning output for the chat API (and ``/v1/responses`` over it).

- ``request.py``: a request's tools and tool_choice, checked; the schema forcing a required or
  named call; the history's tool calls and results as templates expect them
- ``parsers.py``: the tool-call parsers (``--tool-call-parser``) and their streaming
- ``reasoning.py``: the reasoning parsers (``--reasoning-parser``)
- ``chat_format.py``: chat choices and deltas with ``tool_calls`` and ``reasoning_content``
- ``serving.py``: the chat route's step that picks the above for a request
- ``responses_api.py``: ``POST /v1/responses`` served by the chat route
"""
