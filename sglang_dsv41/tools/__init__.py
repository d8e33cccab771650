"""Command-line tools and what their command lines share."""


def help_description(doc: str | None) -> str | None:
    """--help text from a tool's module docstring: its first paragraph (what the tool does)
    and its last (its rules and exit status). None under ``python -OO``, which strips
    docstrings (argparse then prints no description)."""
    if not doc:
        return None
    paragraphs = doc.split("\n\n")
    return " ".join(paragraphs[0].split() + paragraphs[-1].split())
