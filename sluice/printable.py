"""What the CLI prints of the log and the warehouse: a tenant's text with its control characters shown as
escapes, never sent to the operator's terminal.

A batch's metadata or a line's url, a prompt or an error message is the tenant's own text. Printed as it
is, ``\\x1b[2J`` cleared the operator's screen and ``\\x1b]0;...\\x07`` set the terminal's title (an audit:
rich strips a few control codes, not ESC). Tabs and newlines stay.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every C0 and C1 control character but tab and newline written as its escape."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
