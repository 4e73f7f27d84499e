"""The overview and tenant pages and their forms: /admin and /admin/ui/...

Every change goes through the admin API's own handlers (`api/routes/admin.py`), so a quota saved here
is validated the same way and holds from the tenant's next request. Unlike the API's routes these take
the whole `Gateway`: a page shows tenants, quotas, usage rates and the engine's state at once.
"""

from __future__ import annotations

import asyncio
import datetime as dt

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from sqlalchemy import func, select

from loraplex.platform import crud
from loraplex.platform.admin_schemas import KeyIn, QuotaIn, TenantIn
from loraplex.platform.api.deps import GatewayDep
from loraplex.platform.api.routes import admin
from loraplex.platform.dashboard import views
from loraplex.platform.dashboard.auth import Operator, SignedIn, check_csrf
from loraplex.platform.dashboard.pages import DashboardRoute, error_page, redirect, render
from loraplex.platform.errors import APIError, not_found
from loraplex.platform.gateway import Gateway
from loraplex.platform.models import ApiKey, Tenant, utcnow

router = APIRouter(prefix="/admin", include_in_schema=False, route_class=DashboardRoute)
TENANTS_PER_PAGE = 20
KEYS_PER_PAGE = 10
ADAPTERS_PER_PAGE = 10
NOTICES = {
    "created": "Tenant created with the default quotas.",
    "quota": "Quota saved: it holds from the tenant's next request.",
    "revoked": "Key revoked: it is refused from now on.",
    "adapter-deleted": "Adapter deleted.",
    "tenant-deleted": "Tenant deleted: its keys are refused, its adapters unloaded; its usage history stays.",
}
QUOTA_NUMBERS = ("rpm", "tpm", "max_concurrent_requests", "token_budget", "max_adapters", "max_adapter_bytes")
MAX_PAGE = 2**31  # far past any table's last page; a larger one would overflow the query's offset
SCHEDULING_FIELDS = ("weight", "priority", "min_priority")  # never null: a blank one stays as it is


def throughput(request: Request) -> views.Throughput:
    state = request.app.state
    if not hasattr(state, "dashboard_throughput"):
        state.dashboard_throughput = views.Throughput()
    return state.dashboard_throughput


def describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'form'}: {e['msg']}" for e in exc.errors())


def int_param(request: Request, name: str) -> int:
    """A page number from the query string: 1 where it is missing, not a number or out of range."""
    try:
        value = int(request.query_params.get(name, 1))
    except ValueError:
        return 1
    return value if 1 <= value <= MAX_PAGE else 1


# overview ---------------------------------------------------------------------------------------
async def tenant_summaries(gw: Gateway, page_number: int) -> tuple[list[views.TenantSummary], views.Page]:
    def load():
        with gw.sessions() as s:
            total = s.scalar(select(func.count()).select_from(Tenant))
            p = views.page(page_number, TENANTS_PER_PAGE, total)
            tenants, _ = crud.list_tenants(s, p.offset, p.size)
            return views.summarize(s, tenants, utcnow()), p

    rows, p = await asyncio.to_thread(load)
    await views.add_rates(gw, rows)
    return rows, p


async def overview_page(request: Request, gw: Gateway, op: SignedIn, status_code: int = 200,
                        error: str | None = None, name: str = "") -> Response:
    rows, p = await tenant_summaries(gw, int_param(request, "page"))
    panel, _ = await views.engine_panel(gw, throughput(request))
    return render(request, "overview.html", status_code, path="/admin", op=op, rows=rows, page=p, panel=panel,
                  error=error, name=name, notice=NOTICES.get(request.query_params.get("notice", "")),
                  today=utcnow().date())


@router.get("")
async def overview(request: Request, gw: GatewayDep, op: Operator) -> Response:
    return await overview_page(request, gw, op)


@router.get("/ui/engine")
async def engine_fragment(request: Request, gw: GatewayDep, op: Operator) -> Response:
    panel, _ = await views.engine_panel(gw, throughput(request))
    return render(request, "_engine.html", panel=panel)


@router.get("/ui/tenants")
async def tenants_fragment(request: Request, gw: GatewayDep, op: Operator) -> Response:
    rows, p = await tenant_summaries(gw, int_param(request, "page"))
    return render(request, "_tenants.html", path="/admin", rows=rows, page=p)


@router.post("/ui/tenants")
async def create_tenant(request: Request, gw: GatewayDep, op: Operator) -> Response:
    form = await request.form()
    check_csrf(op.csrf_token, form)
    name = str(form.get("name", "")).strip()
    try:
        body = TenantIn(name=name)
    except ValidationError:
        return await overview_page(request, gw, op, 400, "A tenant's name is 1 to 64 letters, digits, '.', '_' "
                                                         "or '-', starting with a letter or digit.", name)

    def create() -> dict:
        with gw.sessions() as s:
            return admin.create_tenant(body, gw.quota_defaults, s, None).model_dump()

    try:
        tenant = await asyncio.to_thread(create)
    except APIError as e:
        return await overview_page(request, gw, op, e.status_code, e.message, name)
    return redirect(f"/admin/ui/tenants/{tenant['id']}?notice=created")


# a tenant ---------------------------------------------------------------------------------------
async def tenant_page(request: Request, gw: Gateway, op: SignedIn, tenant_id: int, status_code: int = 200, *,
                      error: str | None = None, quota_form: dict | None = None,
                      new_key: dict | None = None) -> Response:
    q = request.query_params if request.method == "GET" else {}
    try:
        start = dt.date.fromisoformat(q["start"]) if q.get("start") else None
        end = dt.date.fromisoformat(q["end"]) if q.get("end") else None
    except ValueError:
        return error_page(request, 400, "start and end are dates: YYYY-MM-DD.")
    now = utcnow()
    start, end = views.usage_range(start, end, now.date())

    def load():
        with gw.sessions() as s:
            tenant = s.get(Tenant, tenant_id)
            if tenant is None:
                raise not_found(f"Tenant {tenant_id} does not exist (it may have been deleted).")
            summary = views.summarize(s, [tenant], now)[0]
            keys, keys_page = views.list_keys(s, tenant_id, int_param(request, "keys_page"), KEYS_PER_PAGE)
            adapters, adapters_page = views.list_adapters(s, tenant_id, int_param(request, "adapters_page"),
                                                          ADAPTERS_PER_PAGE)
            charts = views.usage_charts(s, tenant_id, start, end)
            return (summary, tenant.created_at, [(k, views.key_state(k, now)) for k in keys], keys_page,
                    adapters, adapters_page, charts)

    summary, created_at, keys, keys_page, adapters, adapters_page, charts = await asyncio.to_thread(load)
    await views.add_rates(gw, [summary])
    _, tiers = await views.engine_panel(gw, throughput(request))
    return render(request, "tenant.html", status_code, path=f"/admin/ui/tenants/{tenant_id}", op=op, t=summary,
                  created_at=created_at, keys=keys, keys_page=keys_page,
                  adapters=views.adapter_rows(adapters, tiers), adapters_page=adapters_page, charts=charts,
                  start=start, end=end, today=now.date(), error=error, new_key=new_key,
                  quota_form=quota_form or {f: "" if v is None else v for f, v in summary.quota.items()},
                  notice=NOTICES.get(q.get("notice", "")))


@router.get("/ui/tenants/{tenant_id}")
async def tenant(request: Request, tenant_id: admin.RowId, gw: GatewayDep, op: Operator) -> Response:
    return await tenant_page(request, gw, op, tenant_id)


def parse_quota(form) -> dict:
    """The quota form's fields: a blank number means unlimited (null), as in the API."""
    values: dict = {"budget_period": str(form.get("budget_period", "month"))}
    for f in QUOTA_NUMBERS:
        text = str(form.get(f, "")).replace(",", "").replace("_", "").strip()
        values[f] = int(text) if text.lstrip("-").isdigit() else None if not text else text
    for f in SCHEDULING_FIELDS:
        text = str(form.get(f, "")).strip()
        if text:
            values[f] = int(text) if text.lstrip("-").isdigit() else text
    return values


@router.post("/ui/tenants/{tenant_id}/quota")
async def save_quota(request: Request, tenant_id: admin.RowId, gw: GatewayDep, op: Operator) -> Response:
    form = await request.form()
    check_csrf(op.csrf_token, form)
    values = parse_quota(form)
    try:
        body = QuotaIn.model_validate(values)
    except ValidationError as e:
        return await tenant_page(request, gw, op, tenant_id, 400, error=f"Quota not saved: {describe(e)}",
                                 quota_form={k: "" if v is None else v for k, v in values.items()})

    def save() -> None:
        with gw.sessions() as s:
            admin.set_quota(tenant_id, body, s, None)

    try:
        await asyncio.to_thread(save)
    except APIError as e:  # the quota as it would be saved is refused (priority under min_priority)
        if e.status_code != 400:
            raise
        return await tenant_page(request, gw, op, tenant_id, 400, error=f"Quota not saved: {e.message}",
                                 quota_form={k: "" if v is None else v for k, v in values.items()})
    return redirect(f"/admin/ui/tenants/{tenant_id}?notice=quota")


@router.post("/ui/tenants/{tenant_id}/keys")
async def issue_key(request: Request, tenant_id: admin.RowId, gw: GatewayDep, op: Operator) -> Response:
    """Answers with the page itself (not a redirect): the new key is in this response only."""
    form = await request.form()
    check_csrf(op.csrf_token, form)
    days = str(form.get("expires_in_days", "")).strip()
    try:
        body = KeyIn(name=str(form.get("name", "")).strip(),
                     expires_in_s=round(float(days) * 86400) if days else None)
    except (ValidationError, ValueError) as e:
        message = describe(e) if isinstance(e, ValidationError) else "expires in: a number of days"
        return await tenant_page(request, gw, op, tenant_id, 400, error=f"Key not issued: {message}")

    def issue() -> dict:
        with gw.sessions() as s:
            return admin.issue_key(tenant_id, body, s, None).model_dump()

    return await tenant_page(request, gw, op, tenant_id, 201, new_key=await asyncio.to_thread(issue))


@router.post("/ui/tenants/{tenant_id}/keys/{key_id}/revoke")
async def revoke_key(request: Request, tenant_id: admin.RowId, key_id: admin.RowId, gw: GatewayDep, op: Operator) -> Response:
    check_csrf(op.csrf_token, await request.form())

    def revoke() -> None:
        with gw.sessions() as s:
            row = s.get(ApiKey, key_id)
            if row is None or row.tenant_id != tenant_id:
                raise not_found(f"Tenant {tenant_id} has no key {key_id}.")
            admin.revoke_key(key_id, s, None)

    await asyncio.to_thread(revoke)
    return redirect(f"/admin/ui/tenants/{tenant_id}?notice=revoked")


@router.post("/ui/tenants/{tenant_id}/adapters/{name}/delete")
async def delete_adapter(request: Request, tenant_id: admin.RowId, name: str, gw: GatewayDep, op: Operator) -> Response:
    check_csrf(op.csrf_token, await request.form())
    await admin.delete_adapter(tenant_id, name, gw.adapters, None)
    return redirect(f"/admin/ui/tenants/{tenant_id}?notice=adapter-deleted")


@router.post("/ui/tenants/{tenant_id}/delete")
async def delete_tenant(request: Request, tenant_id: admin.RowId, gw: GatewayDep, op: Operator) -> Response:
    check_csrf(op.csrf_token, await request.form())
    await admin.delete_tenant(tenant_id, gw.sessions, gw.adapters, None)
    return redirect("/admin?notice=tenant-deleted")
