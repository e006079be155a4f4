"""Namespace tools (Codex CLI groups tools under a name): flattened for vLLM, restored for the client.

vLLM knows only flat tools, so each sub-tool of a `namespace` tool goes upstream as the function
`<namespace>__<name>` (NeMo Gym's rule), and a replayed call carrying a `namespace` is renamed the
same way. A function call vLLM returns under such a name gets its `namespace` and `name` back.
Both directions do work only for a request that has a namespace tool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from ..schemas.responses import FunctionCallItem, NamespaceTool, OutputItem, Tool

SEPARATOR: Final = "__"

NamespaceMap = dict[str, tuple[str, str]]  # flattened name -> (namespace, name)


def flat_name(namespace: str, name: str) -> str:
    """The function name vLLM sees for `name` inside `namespace`."""
    return f"{namespace}{SEPARATOR}{name}"


def namespace_map(tools: Iterable[Tool] | None) -> NamespaceMap:
    """Each flattened sub-tool name of `tools`, with the namespace and name it came from."""
    names: NamespaceMap = {}
    for tool in tools or ():
        if isinstance(tool, NamespaceTool):
            for sub in tool.tools:
                names[flat_name(tool.name, sub.name)] = (tool.name, sub.name)
    return names


def shown(name: str, names: NamespaceMap) -> tuple[str, str | None]:
    """The (name, namespace) a client sees for a function vLLM called `name`."""
    found = names.get(name)
    return (found[1], found[0]) if found is not None else (name, None)


def restore(items: Iterable[OutputItem], names: NamespaceMap) -> None:
    """Give each flattened function call its namespace and name back, in place."""
    for item in items:
        if isinstance(item, FunctionCallItem) and item.name in names:
            item.namespace, item.name = names[item.name]
