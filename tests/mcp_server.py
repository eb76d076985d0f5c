"""A small MCP server for the tests, written with the `mcp` SDK's MCPServer (FastMCP in mcp 1.x).

Run as a stdio server: `python tests/mcp_server.py`; over Streamable HTTP on loopback:
`python tests/mcp_server.py --http PORT` (endpoint http://127.0.0.1:PORT/mcp).
"""

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("agentrl-test")
calls: list[str] = []  # per server process: shows one session served every episode


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    if abs(a * b) > 10**15:
        raise ToolError(f"{a} * {b} is too large")
    calls.append("multiply")
    return a * b


@server.tool()
def calls_so_far() -> int:
    """How many multiplications this server process has done."""
    return len(calls)


@server.tool()
def authorization(ctx: Context) -> str:
    """The Authorization header the request came with ("none" without one, or over stdio)."""
    return (ctx.headers or {}).get("authorization", "none")


@server.tool()
def ramble(characters: int) -> str:
    """A text of `characters` x's, sent as one line however long.

    Args:
        characters: How long.
    """
    return "x" * characters


@server.tool()
def delete_everything(confirm: bool) -> str:
    """A tool the allow-list must keep from the model."""
    return "deleted"


if __name__ == "__main__":
    import sys

    if "--http" in sys.argv:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[sys.argv.index("--http") + 1]))
    else:
        server.run()
