"""How observers show text that came from the network.

Theory of operation: what members publish (names, roles, progress text, metadata) reaches a
terminal only through ``shown``, which writes control characters as Python escapes, so that
no member can move the cursor or recolour the terminal of whoever reads the mesh; ``rich``
gets it as ``Text``, never as markup. A leaf module, so that every view can use it.
"""

from __future__ import annotations


def shown(text: object) -> str:
    """``text`` from the network as an observer shows it: control characters (terminal
    escape sequences, line breaks) written as Python escapes (``\\x1b``), so a member's name
    or progress text can neither move the cursor nor recolour the terminal. (``rich`` gets
    it as plain ``Text``, never markup: ``[/oops]`` is shown as written.)"""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
