"""The chat route's tool and reasoning step: what the answer is parsed with, checked against the
server's flags and the chat template (app.py calls :func:`chat_output` once per request)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from pagedkv.sampling_params import SamplingParams
from pagedkv.server.responses import ChatFormat
from pagedkv.server.tools.chat_format import ToolChatFormat
from pagedkv.server.tools.parsers import NamedCallStream, RequiredCallsParser, ToolCallStream
from pagedkv.server.tools.request import ToolOptions, check_served, check_template_knows_tools


def chat_output(body: Any, options: ToolOptions | None, tokenizer: Any,
                params: SamplingParams) -> tuple[SamplingParams, ChatFormat]:
    """(the sampling params, adjusted; the response format) for a ChatCompletionRequest.

    400s: auto tool choice on a server without ``--enable-auto-tool-choice``; tools (or tool
    calls in the history) with a chat template that never reads them."""
    options = options or ToolOptions()
    req = body.tool_request
    check_served(req, options)
    check_template_knows_tools(getattr(tokenizer, "chat_template", None), req, body.messages)
    reasoning = options.new_reasoning_parser()
    if params.structured_output is not None:
        # The grammar starts at the first token, so a constrained answer has no thinking to split off.
        reasoning = None
    new_calls: Callable[[], ToolCallStream | NamedCallStream] | None = None  # one call parser per choice
    strip: tuple[str, ...] = ()
    if req.choice == "named":
        new_calls = functools.partial(NamedCallStream, req.named)
    elif req.choice == "required":
        new_calls = _required_calls
    elif req.choice == "auto":
        probe = options.new_tool_parser()
        assert probe is not None  # check_served: auto needs a parser
        new_calls = functools.partial(_auto_calls, options)
        if not probe.skip_special_tokens and "skip_special_tokens" not in body.model_fields_set:
            # The parser's markers are special tokens ([TOOL_CALLS]): decode them; EOS is not content.
            params = dataclasses.replace(params, skip_special_tokens=False)
            strip = tuple(t for t in (getattr(tokenizer, "eos_token", None),) if t)
    if new_calls is None and reasoning is None:
        return params, ChatFormat(body.top_logprobs or 0)
    return params, ToolChatFormat(body.top_logprobs or 0, new_calls=new_calls, reasoning=reasoning, strip=strip)


def _required_calls() -> ToolCallStream:
    return ToolCallStream(RequiredCallsParser())


def _auto_calls(options: ToolOptions) -> ToolCallStream:
    parser = options.new_tool_parser()
    assert parser is not None  # check_served: auto needs a parser
    return ToolCallStream(parser)
