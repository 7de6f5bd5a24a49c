"""A desktop's notification service for the tray's tests: it owns
org.freedesktop.Notifications on the session bus (what a notification daemon such as
the desktop's own does; none is installed here), writes each notification it is sent to
a file as a JSON line ({"title", "message"}), and runs a command meanwhile.

    python notification_service.py NOTIFICATIONS.jsonl COMMAND...

It owns the name before it starts COMMAND, so nothing COMMAND sends is lost, and exits
with COMMAND's exit status when it ends. Run it inside ``dbus-run-session``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from gi.repository import Gio, GLib

INTERFACE = """
<node><interface name="org.freedesktop.Notifications">
  <method name="Notify">
    <arg type="s" direction="in"/><arg type="u" direction="in"/><arg type="s" direction="in"/>
    <arg type="s" direction="in"/><arg type="s" direction="in"/><arg type="as" direction="in"/>
    <arg type="a{sv}" direction="in"/><arg type="i" direction="in"/>
    <arg type="u" direction="out"/>
  </method>
  <method name="CloseNotification"><arg type="u" direction="in"/></method>
  <method name="GetCapabilities"><arg type="as" direction="out"/></method>
  <method name="GetServerInformation">
    <arg type="s" direction="out"/><arg type="s" direction="out"/>
    <arg type="s" direction="out"/><arg type="s" direction="out"/>
  </method>
</interface></node>"""


def main(record: Path, command: list[str]) -> int:
    loop = GLib.MainLoop()
    shown: list[int] = []
    status: list[int] = []

    def call(_connection: Any, _sender: str, _path: str, _interface: str, method: str,
             arguments: GLib.Variant, invocation: Gio.DBusMethodInvocation) -> None:
        if method == "Notify":
            _app, _replaces, _icon, title, message, *_rest = arguments.unpack()
            with record.open("a", encoding="utf-8") as out:
                out.write(json.dumps({"title": title, "message": message}) + "\n")
            shown.append(len(shown) + 1)
            invocation.return_value(GLib.Variant("(u)", (shown[-1],)))
        elif method == "GetCapabilities":
            invocation.return_value(GLib.Variant("(as)", (["body"],)))
        elif method == "GetServerInformation":
            invocation.return_value(GLib.Variant("(ssss)", ("tests", "vramguard", "1", "1.2")))
        else:
            invocation.return_value(None)

    def acquired(connection: Gio.DBusConnection, _name: str) -> None:
        node = Gio.DBusNodeInfo.new_for_xml(INTERFACE)
        connection.register_object("/org/freedesktop/Notifications", node.interfaces[0],
                                   call, None, None)
        child = subprocess.Popen(command)

        def check() -> bool:
            if child.poll() is None:
                return True
            status.append(child.returncode)
            loop.quit()
            return False

        GLib.timeout_add(200, check)

    Gio.bus_own_name(Gio.BusType.SESSION, "org.freedesktop.Notifications",
                     Gio.BusNameOwnerFlags.NONE, None, acquired, lambda *_: loop.quit())
    loop.run()
    return status[0] if status else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
