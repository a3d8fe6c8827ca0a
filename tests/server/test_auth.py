"""Who may use the API: nothing is served off loopback without a token; the report token may only post a
calibration record; a token never travels in clear or shows in ps."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server import cli
from server.app import create_app
from server.middleware import BearerToken
from server.settings import Settings

API, REPORT = "api-token", "report-token"


@pytest.fixture(autouse=True)
def no_tokens_from_the_environment(monkeypatch, tmp_path: Path) -> None:
    for name in ("EDGE_API_TOKEN", "EDGE_REPORT_TOKEN", "EDGE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def served(monkeypatch) -> dict:
    """edge-serve's planner, not served: main() returns once it would start serving."""
    seen: dict = {}
    monkeypatch.setattr(cli, "serve_app", lambda settings, app: seen.update(settings=settings, app=app))
    return seen


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "edge-box.local"])
@pytest.mark.parametrize("token", [None, "", "  "], ids=["unset", "empty", "blank"])
def test_serving_a_public_address_without_a_token_is_refused(host, token, served, monkeypatch, capsys):
    if token is not None:
        monkeypatch.setenv("EDGE_API_TOKEN", token)
    assert cli.main(["--plan-only", "--host", host]) == 2
    err = capsys.readouterr().err
    assert f"--host {host!r}" in err and "EDGE_API_TOKEN is not set" in err and "refusing to serve" in err
    assert served == {}


@pytest.mark.parametrize("host, token", [("127.0.0.1", None), ("localhost", None), ("::1", None), ("0.0.0.0", API)])
def test_loopback_without_a_token_or_a_public_address_with_one_is_served(host, token, served, monkeypatch):
    if token:
        monkeypatch.setenv("EDGE_API_TOKEN", token)
    assert cli.main(["--plan-only", "--host", host]) == 0
    assert served["settings"].host == host and served["settings"].api_token == token


@pytest.fixture
def guarded(tmp_path: Path) -> TestClient:
    settings = Settings(api_token=API, report_token=REPORT, calibration_db=f"sqlite:///{tmp_path / 'c.sqlite'}")
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize("method, path", [("GET", "/calibrations"), ("POST", "/plan"), ("GET", "/plan"),
                                          ("GET", "/status"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                                          ("GET", "/probe")])  # fmt: skip
def test_the_report_token_cannot_plan_read_or_reach_the_engine(guarded, method, path):
    response = guarded.request(method, path, headers=bearer(REPORT), json={})
    assert response.status_code == 403
    assert response.json()["detail"] == f"the report token may only POST /calibrations, not {method} {path}"


def test_the_report_token_can_post_a_calibration_record(guarded):
    response = guarded.post("/calibrations", headers=bearer(REPORT), json={})
    assert response.status_code == 422  # past the token: the (empty) record itself is refused


def test_the_api_token_can_do_what_the_report_token_cannot(guarded):
    assert guarded.get("/calibrations", headers=bearer(API)).status_code == 200
    assert guarded.get("/status", headers=bearer(API)).status_code == 200


@pytest.mark.parametrize("path", ["/healthz/", "/healthz/x", "/readyzz", "/Healthz"])
def test_an_open_path_is_open_only_as_written(guarded, path):
    assert guarded.get(path).status_code == 401


async def asgi_get(middleware: BearerToken, path: str, token: str | None, method: str = "GET") -> tuple[int, dict]:
    """One request through the middleware alone; the app behind it records the scope's state. Its receive
    fails the test if called: the token is checked before anything reads the body."""
    seen: dict = {}

    async def app(scope, receive, send):
        seen.update(scope.get("state", {}))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        pytest.fail("the body was read before the token was checked")

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    middleware.app = app
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "state": {"shared": 1}}
    await middleware(scope, receive, send)
    return sent[0]["status"], seen


@pytest.mark.anyio
@pytest.mark.parametrize(
    "token, method, status, role",
    [(API, "GET", 204, "api"), (API, "POST", 204, "api"), (REPORT, "POST", 204, "report"),
     (REPORT, "GET", 403, None), ("wrong", "POST", 401, None), (None, "POST", 401, None)],
)  # fmt: skip
async def test_the_middleware_names_the_role_of_the_token_before_any_body_is_read(token, method, status, role):
    guard = BearerToken(None, API, frozenset({"/healthz"}), report_token=REPORT)
    answered, state = await asgi_get(guard, "/calibrations", token, method)
    assert answered == status and state.get("token_role") == role
    assert not state or state["shared"] == 1  # the rest of the request's state is kept


@pytest.mark.anyio
async def test_a_report_token_equal_to_the_api_token_is_the_api_token():
    guard = BearerToken(None, API, frozenset(), report_token=API)
    assert await asgi_get(guard, "/status", API) == (204, {"shared": 1, "token_role": "api"})


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("url", ["http://planner:8080", "http://10.0.0.9", "http://[2001:db8::1]:8080"])
def test_a_report_token_is_never_sent_in_clear_to_another_host(url, served, monkeypatch, capsys):
    monkeypatch.setenv("EDGE_REPORT_TOKEN", REPORT)
    monkeypatch.setattr(cli, "host_calibration", lambda **k: pytest.fail("refused before anything is measured"))
    assert cli.main(["--plan-only", "--report-to", url]) == 2
    err = capsys.readouterr().err
    assert "--report-to: expected an https:// URL" in err and url in err and REPORT not in err
    assert served == {}


@pytest.mark.parametrize("url, token", [("https://planner:8080", REPORT), ("http://127.0.0.1:8080", REPORT),
                                        ("http://planner:8080", None)])  # fmt: skip
def test_tls_loopback_or_no_token_may_report(url, token):
    cli.check_report_to(url, token)


def test_the_report_token_comes_from_a_file_before_the_command_line_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_REPORT_TOKEN", "from-env")
    path = tmp_path / "report-token"
    path.write_text("from-file\n")
    args = cli.parser().parse_args(["--report-token-file", str(path), "--report-token", "from-argv"])
    assert cli.report_token(args, Settings()) == "from-file"
    assert cli.report_token(cli.parser().parse_args([]), Settings()) == "from-env"


@pytest.mark.parametrize("content", [None, "\n"], ids=["missing", "empty"])
def test_an_unreadable_report_token_file_exits_2_naming_the_flag(content, tmp_path, served, capsys):
    path = tmp_path / "report-token"
    if content is not None:
        path.write_text(content)
    assert cli.main(["--plan-only", "--report-to", "https://planner", "--report-token-file", str(path)]) == 2
    assert capsys.readouterr().err.startswith("edge-serve: --report-token-file: expected a")


def test_a_token_on_the_command_line_is_warned_about(served, monkeypatch, capsys):
    def no_record(**_):
        raise cli.CalibrationFailed("none cached")

    monkeypatch.setattr(cli, "host_calibration", no_record)
    assert cli.main(["--plan-only", "--report-to", "http://127.0.0.1:9", "--report-token", REPORT]) == 0
    assert "--report-token is visible to every user of this box (ps)" in capsys.readouterr().err

