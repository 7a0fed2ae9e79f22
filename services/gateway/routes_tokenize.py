"""POST /tokenize and /detokenize, in vLLM's shapes.

/tokenize takes ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
"add_generation_prompt": true}`` (and the chat's ``continue_final_message``, ``chat_template_kwargs``) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
/detokenize takes ``{"tokens": [...]}`` and answers ``{"prompt": str}``. A text proved longer than
the workers' context (by its length alone, see tokenization.py) is refused untokenized (400,
``context_length_exceeded``); any other text is counted, also past the context.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from services.gateway.auth import require_api_key
from services.gateway.deps import GatewayDep
from services.gateway.openapi import api_responses
from services.gateway.prompts import chat_prompt, check_model, check_token_ids, request_chat_template
from services.gateway.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from services.gateway.valid_text import require_valid_text

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/tokenize", response_model=TokenizeResponse, responses=api_responses(413))
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, gw: GatewayDep) -> TokenizeResponse:
    require_valid_text(body)
    check_model(body.model, gw.model_name)
    tok = gw.tokenizer
    max_model_len = gw.pool.max_model_len
    if isinstance(body, TokenizeChatRequest):
        ids = await chat_prompt(
            body.messages, gw.prompts, body.add_generation_prompt, max_model_len, None,
            body.continue_final_message, body.chat_template_kwargs, None, body.add_special_tokens,
            request_chat_template(body.chat_template, gw.settings.trust_request_chat_template),
        )  # fmt: skip
    else:
        (ids,) = await gw.prompts.encode([body.prompt], max_model_len, "prompt", body.add_special_tokens)
    token_strs = [tok.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=gw.pool.max_model_len, tokens=ids, token_strs=token_strs
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses=api_responses())
async def detokenize(body: DetokenizeRequest, gw: GatewayDep) -> DetokenizeResponse:
    require_valid_text(body)
    check_model(body.model, gw.model_name)
    check_token_ids(body.tokens, gw.tokenizer.vocab_size, "tokens")
    text = await gw.prompts.decode(body.tokens)
    return DetokenizeResponse(prompt=text)
