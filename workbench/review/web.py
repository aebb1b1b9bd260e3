"""The review web UI: FastAPI with server-rendered Jinja2 templates (no JavaScript needed).

Pages: ``/`` the queue; ``/pool`` the pool's progress (each verdict queued, running, done or error;
``workbench.pool``); ``/items/{id}`` one candidate (task and declared scope, verdicts with
evidence, perf table and speedup-vs-batch plot, the diff, the dispatch trace, the agent transcript,
the reproduce command, approve/reject forms, the transition history). A result with SKIP verdicts
("accepted, not judged") gets a banner naming each unjudged guard and why, its row in the queue says
so, and its approve form needs an "accept unjudged" reason, which goes into the merge commit. Forms POST to
``/items/{id}/approve`` and ``/items/{id}/reject`` with a per-server token, so another web page
open in the same browser cannot approve a merge. Errors (an unknown candidate or page, a bad form)
are HTML pages with the status code, never JSON.
"""

from __future__ import annotations

import collections
import secrets
from http import HTTPStatus
from pathlib import Path
from urllib.parse import urlencode

import git
from fastapi import FastAPI, Form, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

from workbench.errors import WorkbenchError
from workbench.review import gitops, service
from workbench.review.plot import speedup_vs_batch_png
from workbench.review.store import ReviewError, ReviewStore, State

TEMPLATES = Path(__file__).parent / "templates"
TRANSCRIPT_MAX_BYTES = 200_000
TRACE_MAX_ROWS = 500


def create_app(store: ReviewStore, repo_root: Path, *, reviewer: str | None = None) -> FastAPI:
    """The web app over one store and one repository.

    Args:
        store: the review queue.
        repo_root: the repository whose branches are merged.
        reviewer: default reviewer name in the forms (default: git config user.name).
    """
    root = Path(repo_root).resolve()
    app = FastAPI(title="kernel-workbench review", docs_url=None, redoc_url=None, openapi_url=None)
    templates = Jinja2Templates(directory=str(TEMPLATES))
    token = secrets.token_urlsafe(24)
    default_name = reviewer or service.default_reviewer(root)

    @app.exception_handler(StarletteHTTPException)
    def http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if exc.status_code != 404 or exc.detail != "Not Found" else (
            f"There is no page {request.url.path}; the queue lists every candidate.")
        return error_page(request, exc.status_code, str(detail))

    @app.exception_handler(RequestValidationError)
    def bad_request(request: Request, exc: RequestValidationError):
        in_path = any(e.get("loc", ("",))[0] == "path" for e in exc.errors())
        if in_path:  # /items/abc: no such candidate, not a malformed form
            return error_page(request, 404, f"There is no candidate {request.url.path.split('/')[2]!r}: "
                                            "queue ids are numbers; the queue lists every candidate.")
        return error_page(request, 422, "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                                                   for e in exc.errors()))

    def error_page(request: Request, status: int, detail: str) -> HTMLResponse:
        try:
            title = HTTPStatus(status).phrase
        except ValueError:
            title = ""
        return templates.TemplateResponse(request, "error.html", {
            "status": status, "title": title, "detail": detail, "states": [s.value for s in State]},
            status_code=status)

    def item_or_404(item_id: int):
        try:
            return store.get(item_id)
        except ReviewError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None

    def judged(item) -> str:
        """The queue's ``judged`` cell: the judgement label, or why the result file cannot be read."""
        try:
            return service.judgement_label(service.load_item_result(item))
        except WorkbenchError as exc:
            return "result file changed since submission" if "changed since submission" in str(exc) else (
                "result file unreadable")

    @app.get("/", response_class=HTMLResponse)
    def queue(request: Request, state: str | None = None):
        states = [State(state)] if state in {s.value for s in State} else None
        items = store.items(states)
        return templates.TemplateResponse(request, "queue.html", {
            "items": items, "judged": {it.id: judged(it) for it in items}, "counts": store.counts(),
            "state": state, "states": [s.value for s in State], "db": store.url})

    @app.get("/pool", response_class=HTMLResponse)
    def pool(request: Request):
        from workbench.pool import read_boards

        return templates.TemplateResponse(request, "pool.html", {
            "boards": read_boards(root), "states": [s.value for s in State]})

    @app.get("/items/{item_id}", response_class=HTMLResponse)
    def candidate(request: Request, item_id: int, msg: str | None = None, level: str = "ok"):
        item = item_or_404(item_id)
        ctx = {"item": item, "msg": msg, "level": level, "token": token, "reviewer": default_name,
               "problems": [], "result": None, "task": None, "diff": "", "diff_paths": (), "check": None,
               "trace_summary": [], "trace": [], "transcript": None, "states": [s.value for s in State],
               "unjudged": (), "unjudged_banner": None}
        try:
            result = service.load_item_result(item)
            ctx["result"] = result
        except ReviewError as exc:
            ctx["problems"].append(str(exc))
            return templates.TemplateResponse(request, "candidate.html", ctx)
        try:
            from workbench.taskspec import load_task

            ctx["task"] = load_task(root, item.task_id)
        except WorkbenchError as exc:
            ctx["problems"].append(f"Task spec: {exc}")
        repo = git.Repo(root)
        try:
            ctx["diff"], ctx["diff_paths"] = gitops.candidate_diff(repo, item.base_commit, item.candidate_commit)
            extra = sorted(set(ctx["diff_paths"]) - set(result.candidate.changed_paths))
            if extra:
                ctx["problems"].append(f"The diff touches paths the guards did not judge: {', '.join(extra)}; "
                                       "do not approve, re-run the guards.")
            if item.state in (State.QUEUED.value, State.APPROVED.value):
                ctx["check"] = gitops.check_merge(repo, item.target_branch, item.base_commit, item.candidate_commit)
        except (git.GitCommandError, ReviewError) as exc:
            ctx["problems"].append(f"git: {str(exc).splitlines()[0]}")
        refusal = service.verdict_refusal(result)
        if refusal:
            ctx["problems"].append(f"Cannot be approved: {refusal}.")
        ctx["unjudged"] = service.unjudged_verdicts(result)
        ctx["unjudged_banner"] = service.unjudged_banner(result)
        counter = collections.Counter((d.get("implementation", "?"), d.get("reason", "")) for d in result.dispatch_trace)
        ctx["trace_summary"] = sorted(counter.items(), key=lambda kv: -kv[1])
        ctx["trace"] = result.dispatch_trace[:TRACE_MAX_ROWS]
        tp = result.candidate.transcript_path
        if tp:
            p = Path(tp) if Path(tp).is_absolute() else root / tp
            if p.is_file():
                ctx["transcript"] = p.read_bytes()[:TRANSCRIPT_MAX_BYTES].decode("utf-8", errors="replace")
            else:
                ctx["problems"].append(f"Transcript {tp} is named in the result but does not exist.")
        return templates.TemplateResponse(request, "candidate.html", ctx)

    @app.get("/items/{item_id}/speedup.png")
    def plot(item_id: int):
        item = item_or_404(item_id)
        try:
            result = service.load_item_result(item)
        except ReviewError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        batch_axis = "T"
        try:
            from workbench.taskspec import load_task

            batch_axis = load_task(root, item.task_id).scope.batch_axis
        except WorkbenchError:
            pass
        return Response(speedup_vs_batch_png(result, batch_axis), media_type="image/png",
                        headers={"Cache-Control": "no-store"})

    def check_form(form_token: str, who: str) -> str:
        if not secrets.compare_digest(form_token, token):
            raise HTTPException(status_code=403, detail="Form token does not match this server; reload the page.")
        who = who.strip()
        if not who:
            raise HTTPException(status_code=400, detail="Reviewer name is empty; type your name in the form.")
        return who

    def back(item_id: int, msg: str, level: str) -> RedirectResponse:
        return RedirectResponse(f"/items/{item_id}?{urlencode({'msg': msg, 'level': level})}", status_code=303)

    @app.post("/items/{item_id}/approve")
    def approve(item_id: int, reviewer: str = Form(""), token_: str = Form("", alias="token"),
                accept_unjudged: str | None = Form(None)):
        """``accept_unjudged``: the form's reason field, shown only for a result with SKIP verdicts; a blank
        one counts as none given (the approval is refused and says a reason is needed)."""
        who = check_form(token_, reviewer)
        item_or_404(item_id)
        try:
            item = service.approve(store, root, item_id, reviewer=who,
                                   accept_unjudged=(accept_unjudged or "").strip() or None)
        except ReviewError as exc:
            return back(item_id, str(exc), "error")
        return back(item_id, f"Merged into {item.target_branch} as {item.merge_commit[:12]}.", "ok")

    @app.post("/items/{item_id}/reject")
    def reject(item_id: int, reviewer: str = Form(""), reason: str = Form(""), token_: str = Form("", alias="token")):
        who = check_form(token_, reviewer)
        item_or_404(item_id)
        try:
            service.reject(store, item_id, reviewer=who, reason=reason)
        except ReviewError as exc:
            return back(item_id, str(exc), "error")
        return back(item_id, "Rejected.", "ok")

    app.state.token = token
    return app
