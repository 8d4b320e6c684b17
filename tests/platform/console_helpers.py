"""Signing in to the console from a TestClient, and posting with the session's CSRF token."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi.testclient import TestClient

CSRF_META = re.compile(r'<meta name="csrf-token" content="([^"]+)">')
FORM_TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


@dataclass
class Console:
    client: TestClient
    app: object
    admin_key: str
    csrf: str = ""

    def sign_in(self) -> str:
        page = self.client.get("/console/login")
        token = FORM_TOKEN.search(page.text).group(1)
        r = self.client.post("/console/login", data={"csrf_token": token, "credential": self.admin_key},
                             follow_redirects=False)
        assert r.status_code == 303, r.text
        self.csrf = CSRF_META.search(self.client.get("/console/dashboard").text).group(1)
        return self.csrf

    def post(self, path: str, data: dict | None = None, **kw):
        return self.client.post(path, data={"csrf_token": self.csrf, **(data or {})}, follow_redirects=False, **kw)

    def sessions(self):
        return self.app.state.services.sessions()
