"""`/ui`: the page of the four clocks, served as three static files from package data.

Owns: reading ``static/index.html``, ``static/app.js`` and ``static/app.css`` once, and serving
them without a token (the page holds no data: every call it makes carries the token the person
gives it, sent as ``Authorization: Bearer``) under a Content-Security-Policy that allows this
origin's script, style and fetches and nothing else: no inline script or handler, no image, no
frame, no form target, so even markup that reached the DOM could neither run nor load.

Must never: serve anything but these files (no path from the request reaches the filesystem),
put data in the page, or take a token from the query string (it would land in access logs; the
page reads one from the URL fragment, which is never sent). The fragment also links to a task:
``/ui#task=T`` opens with T selected (the page checks the id and shows only what the token's
stream shows).
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

FILES = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
}
OPEN_PATHS = frozenset(FILES) | {"/ui/"}  # "/ui/" only redirects to "/ui"
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


class Page:
    """The three files, read once when the app is made (a missing one fails loudly then)."""

    def __init__(self) -> None:
        static = resources.files("settled.server").joinpath("static")
        self.files = {
            path: (static.joinpath(name).read_bytes(), media)
            for path, (name, media) in FILES.items()
        }

    async def serve(self, request: Request) -> Response:
        body, media = self.files[request.url.path]
        return Response(body, media_type=media, headers=HEADERS)
