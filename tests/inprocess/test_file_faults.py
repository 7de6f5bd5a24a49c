"""Faults in the files the app reads, in process: a truncated weights file (the doctor and
/readyz name it and say what to do) and a token file deleted while the app runs (written
back). Faults that need a server process of their own: live/test_faults.py."""

from __future__ import annotations

import asyncio

import httpx
from asgi import BASE_URL, make_settings

from app.cli.main import main
from app.host.token_file import load_or_create_token
from app.http.server import create_app


def test_a_truncated_weights_file_names_the_file_and_what_to_do(tmp_path, capsys):
    weights = tmp_path / "resnet50.pth"
    weights.write_bytes(b"PK\x03\x04 not the rest of a weights file")
    assert main(["doctor", "--model", "resnet50", "--weights", str(weights)]) == 1
    out = capsys.readouterr().out
    assert f"The weights file {weights} is damaged or incomplete" in out
    assert "Download it again" in out

    async def starting() -> str:  # the server: /readyz says why, the process lives on
        settings = make_settings(tmp_path, model="resnet50", weights=weights)
        app = create_app(settings)
        engine = app.state.vg.engine
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
                response = await client.get("/readyz")
            assert response.status_code == 503
            return str(response.json()["error"]["message"])
        finally:
            await asyncio.to_thread(engine.stop)

    message = asyncio.run(starting())
    assert str(weights) in message and "damaged or incomplete" in message


def test_a_token_file_deleted_while_running_is_written_back(tmp_path):
    settings = make_settings(tmp_path)
    app = create_app(settings)
    token = settings.token_file.read_text().strip()

    async def admin_call(bearer: str) -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            response = await client.post("/v1/admin/ui-link",
                                         headers={"Authorization": f"Bearer {bearer}"})
        return response.status_code

    settings.token_file.unlink()
    assert asyncio.run(admin_call(token)) == 200  # the server's token still works ...
    assert settings.token_file.read_text().strip() == token  # ... and the file is back

    settings.token_file.unlink()  # this time the tray reads the file first and makes one
    newer = load_or_create_token(settings.token_file)
    assert newer != token
    assert asyncio.run(admin_call(newer)) == 200  # the server follows the file
    assert asyncio.run(admin_call(token)) == 401
