"""GET /v1/models and /v1/models/{id}: the one model this gateway serves."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from services.gateway.auth import require_api_key
from services.gateway.deps import GatewayDep
from services.gateway.openapi import api_responses
from services.gateway.prompts import check_model
from services.gateway.schemas import ModelCard, ModelList
from services.gateway.service import DEMO_NOTE, GatewayService

router = APIRouter(dependencies=[Depends(require_api_key)])


def model_card(gw: GatewayService) -> ModelCard:
    return ModelCard(
        id=gw.model_name,
        created=gw.created,
        root=str(gw.model_dir),
        max_model_len=gw.pool.max_model_len,
        yutu_note=DEMO_NOTE if gw.pool.demo else None,
    )


@router.get(
    "/v1/models", response_model=ModelList, response_model_exclude_none=True, responses=api_responses()
)
async def list_models(gw: GatewayDep) -> ModelList:
    return ModelList(data=[model_card(gw)])


@router.get(
    "/v1/models/{model_id:path}",
    response_model=ModelCard,
    response_model_exclude_none=True,
    responses=api_responses(),
)
async def retrieve_model(model_id: str, gw: GatewayDep) -> ModelCard:
    check_model(model_id, gw.model_name)
    return model_card(gw)
