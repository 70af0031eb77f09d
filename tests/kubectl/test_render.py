"""What the cluster's strings can do to the terminal of an admin who runs the plugin: nothing. A
node's agent writes its GpuUsage (the pods' names in it) and its Device (the GPU model) as it likes,
so a compromised node could name a pod `[link=...]` (a clickable link, read as markup), `x[/]` (a
markup error that hid every row) or `\\x1b]0;...` (a raw escape sequence)."""

from __future__ import annotations

import io

import pytest

from sharegpu.kubectl import render, views

HOSTILE = ["[link=https://evil.example/login]train-0[/link]", "x[/]", "y\x1b]0;pwned\x07z", "w\x9b31m"]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_pod_name_is_shown_as_text(name: str) -> None:
    row = views.UsageRow("ns", name, "n0", "0", 500, 1024, 100, 10, 5)
    for terminal in (False, True):
        buffer = io.StringIO()
        shown = render.console(file=buffer, width=200, force_terminal=terminal)
        shown.print(render.printable(shown, render.top_table([row])))
        out = buffer.getvalue()
        assert "\x1b]" not in out and "\x07" not in out and "\x9b" not in out, repr(out)
        assert "evil.example" not in name or "[link=https://evil.example/login]" in out, "shown as written"
    visible = "".join(c for c in name if c.isprintable())
    assert visible in render.plain(render.top_table([row])).replace("\ufffd", ""), "the rest of the name is shown"
