"""Text primitives shared by the corpus builder: paragraphs, normalised words, 13-grams.

A paragraph is a block of lines separated by one or more blank (whitespace-only) lines. The
normalised form of a paragraph is its lower-cased runs of letters and digits; two paragraphs
that differ only in case, punctuation or spacing normalise to the same word list, which is what
the leak filter compares.

Also the converters from the sources' markup to plain prose paragraphs: Perl POD (`pod_text`),
HTML (`html_text`, standard library `html.parser` only), reStructuredText (`rst_text`) and the
tagged Brown corpus (`brown_text`). Each drops what is not prose (code, navigation, tables)
rather than try to render it, since the corpus is for learning English.
"""

from __future__ import annotations

import hashlib
import html.entities
import re
from html.parser import HTMLParser

_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def paragraphs(text: str) -> list[str]:
    """Blank-line-separated blocks of `text`, stripped of surrounding blank space."""
    return [p.strip("\n") for p in _BLANK_LINES.split(text.strip()) if p.strip()]


def join_paragraphs(paras: list[str]) -> str:
    """Inverse of `paragraphs` up to blank-line spacing; a file ends with one newline."""
    return "\n\n".join(paras) + "\n" if paras else ""


def words(text: str) -> list[str]:
    """Normalised words: lower-cased runs of Unicode letters/digits."""
    return _WORD.findall(text.lower())


def paragraph_key(text: str) -> str | None:
    """Stable hash of a paragraph's normalised words, or None if it has no words."""
    w = words(text)
    if not w:
        return None
    return hashlib.sha1(" ".join(w).encode("utf-8")).hexdigest()


def ngrams(word_list: list[str], n: int = 13):
    """All consecutive n-word tuples of `word_list` (none if it is shorter than n)."""
    return (tuple(word_list[i:i + n]) for i in range(len(word_list) - n + 1))


_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_OLD_NOTICE = re.compile(r"<<.*?>>", re.S)  # 1990s Gutenberg/World Library copyright notices


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg licence headers/footers and inline notices from `text`.

    Keeps the text between the `*** START OF ... ***` and `*** END OF ... ***` markers when they
    exist, then drops `<<...>>` notices and any paragraph that mentions Project Gutenberg or its
    e-text boilerplate.
    """
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    text = _OLD_NOTICE.sub("", text)
    keep = [p for p in paragraphs(text)
            if not re.search(r"project gutenberg|gutenberg\.org|\be-?texts?\b", p, re.I)]
    return join_paragraphs(keep)


# --- Perl POD -------------------------------------------------------------------------------
_POD_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t]*\n)+")
_POD_COMMAND = re.compile(r"=([A-Za-z]\w*)\s*(.*)", re.S)
# A formatting code: `X<`, or `X<< ` (two or more brackets then whitespace), closed by `>`, or
# by whitespace then as many brackets.
_POD_CODE = re.compile(r"([A-Z])<(?:(<+)\s+)?")
_POD_CLOSE = re.compile(r">")
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}
_POD_BULLET = re.compile(r"[\s*\-+.o()\d]*")  # `=item *`, `=item 2.`: no text of their own


def _pod_escape(name: str) -> str:
    name = name.strip()
    if name in _POD_ESCAPES:
        return _POD_ESCAPES[name]
    try:
        if name.lower().startswith("0x"):
            return chr(int(name, 16))
        if name.isdigit():
            return chr(int(name, 8) if name.startswith("0") else int(name))
    except (ValueError, OverflowError):
        return ""
    return html.entities.html5.get(name + ";", "")


def _pod_link(inner: str) -> str:
    """What `L<...>` reads as: its text, else the URL, else `"section" in page`."""
    if "|" in inner:
        return inner.split("|", 1)[0].strip()
    if re.match(r"[a-z][a-z0-9+.-]*:[^:\s]\S*$", inner):
        return inner
    if "/" in inner:
        page, section = inner.split("/", 1)
        section = f'"{section.strip().strip(chr(34))}"'
        return f"{section} in {page.strip()}" if page.strip() else section
    if inner.startswith('"') and inner.endswith('"'):
        return inner
    return inner.strip()


def _pod_apply(code: str, inner: str) -> str:
    if code in "XZ":
        return ""
    if code == "E":
        return _pod_escape(inner)
    if code == "L":
        return _pod_link(inner)
    return inner  # B, I, C, F, S and unknown codes: their text


def _pod_expand(s: str, i: int, close):
    """Expand formatting codes of `s` from `i` up to `close` (a regex); returns (text, end)."""
    out = []
    while True:
        code = _POD_CODE.search(s, i)
        end = close.search(s, i) if close is not None else None
        if end is not None and (code is None or end.start() < code.start()):
            out.append(s[i:end.start()])
            return "".join(out), end.end()
        if code is None:
            out.append(s[i:])
            return "".join(out), len(s)
        out.append(s[i:code.start()])
        inner_close = (re.compile(r"\s+" + ">" * (len(code.group(2)) + 1)) if code.group(2)
                       else _POD_CLOSE)
        inner, i = _pod_expand(s, code.end(), inner_close)
        out.append(_pod_apply(code.group(1), inner))


def pod_inline(text: str) -> str:
    """`text` with POD formatting codes (B<>, C<< >>, L<>, E<>, X<>, ...) replaced by their text."""
    return _pod_expand(text, 0, None)[0]


def pod_text(source: str) -> str:
    """The prose of a Perl POD document, one paragraph per ordinary paragraph or heading.

    Kept: `=head` headings, `=item` texts that are more than a bullet or a number, and ordinary
    paragraphs with their lines joined and formatting codes reduced to their text. Dropped:
    verbatim (indented) paragraphs, which are code or command lines; `=begin`/`=end` and `=for`
    blocks, which are for other formatters; everything outside POD (before the first command
    and after `=cut`).
    """
    out, in_pod, begin = [], False, 0
    for para in _POD_PARAGRAPH_BREAK.split(source.replace("\r\n", "\n")):
        if not para.strip():
            continue
        command = _POD_COMMAND.match(para) if para.startswith("=") else None
        if command:
            name, rest = command.group(1), command.group(2)
            in_pod = name != "cut"
            if name == "begin":
                begin += 1
            elif name == "end":
                begin = max(0, begin - 1)
            elif begin == 0 and (name.startswith("head") or name == "item"):
                line = " ".join(pod_inline(rest).split())
                if not _POD_BULLET.fullmatch(line):
                    out.append(line)
            continue
        if not in_pod or begin or para[0] in " \t":
            continue
        line = " ".join(pod_inline(para).split())
        if line:
            out.append(line)
    return join_paragraphs(out)


# --- HTML -----------------------------------------------------------------------------------
class _HtmlProse(HTMLParser):
    """Collects the text of block elements as paragraphs, skipping non-prose elements."""

    SKIP_TAGS = {"head", "script", "style", "noscript", "pre", "table", "svg", "math",
                 "object", "iframe", "template", "button", "select", "textarea"}
    # Page furniture: DocBook's navigation bars, tables of contents, index and code synopses;
    # Sphinx's sidebars, navigation links, footers and the `¶` links of headings; the menus
    # and navigation panels of the Django, SQLAlchemy, SQLite, Erlang and Publican themes.
    SKIP_CLASSES = {"navheader", "navfooter", "toc", "index", "synopsis", "cmdsynopsis",
                    "funcsynopsis", "sphinxsidebar", "related", "footer", "headerlink", "nav",
                    "highlight", "toctree-wrapper", "topbar", "flipMenu", "panel-sections",
                    "expand-collapse-items", "docnav", "menu", "searchmenu", "tagline"}
    SKIP_IDS = {"hd", "ft", "sidebar", "global-nav", "searchbox", "docs-header",
                "docs-top-navigation-container", "docs-sidebar", "fixed-sidebar",
                "docs-bottom-navigation", "docs-copyright", "banner", "submenu", "leftnav"}
    SKIP_ROLES = {"navigation", "search", "banner", "contentinfo"}
    BLOCK_TAGS = {"address", "article", "aside", "blockquote", "body", "caption", "dd", "div",
                  "dl", "dt", "figcaption", "figure", "footer", "h1", "h2", "h3", "h4", "h5",
                  "h6", "header", "html", "li", "main", "nav", "ol", "p", "section", "ul"}
    VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
                 "param", "source", "track", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs, self._buffer, self._stack, self._skipping = [], [], [], 0

    def _flush(self):
        line = " ".join("".join(self._buffer).split())
        self._buffer = []
        if line:
            self.paragraphs.append(line)

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID_TAGS:
            if tag == "br":
                self._buffer.append(" ")
            return
        attrs = dict(attrs)
        classes = set((attrs.get("class") or "").split())
        skip = (tag in self.SKIP_TAGS or bool(classes & self.SKIP_CLASSES)
                or attrs.get("id") in self.SKIP_IDS or attrs.get("role") in self.SKIP_ROLES)
        self._stack.append((tag, skip))
        self._skipping += skip
        if tag in self.BLOCK_TAGS and not self._skipping:
            self._flush()

    def handle_endtag(self, tag):
        if tag in self.VOID_TAGS or all(t != tag for t, _ in self._stack):
            return
        while self._stack:  # close unclosed elements inside this one too
            t, skip = self._stack.pop()
            self._skipping -= skip
            if t == tag:
                break
        if tag in self.BLOCK_TAGS and not self._skipping:
            self._flush()

    def handle_data(self, data):
        if not self._skipping:
            self._buffer.append(data)


def html_text(source: str) -> str:
    """The prose of an HTML page: the text of its block elements (headings, paragraphs, list
    items, definitions), one paragraph each, whitespace collapsed.

    Dropped: the head, scripts and styles, preformatted blocks (code, screen output, synopses),
    tables (DocBook's function and parameter tables are reference data, not prose), and the
    page furniture of DocBook and Sphinx pages (navigation, tables of contents, index,
    sidebars, footers).
    """
    parser = _HtmlProse()
    parser.feed(source)
    parser.close()
    parser._flush()
    return join_paragraphs(parser.paragraphs)


# --- reStructuredText -----------------------------------------------------------------------
_RST_ROLE = re.compile(r":[\w:+.-]+:`([^`<]*?)\s*(?:<[^`>]*>)?`")
_RST_LINK = re.compile(r"`([^`<]+?)\s*(?:<[^`>]*>)?`__?")
_RST_MARKUP = re.compile(r"``(.+?)``|\*\*(.+?)\*\*|(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?!\w)")
_RST_UNDERLINE = re.compile(r"([=\-~^\"'`#*+.:_])\1{2,}\s*")
# Directives whose content is code, data or a table, not prose.
_RST_CODE_DIRECTIVES = re.compile(
    r"\.\. (code|code-block|sourcecode|literalinclude|highlight|parsed-literal|productionlist|"
    r"math|csv-table|list-table|table|image|figure|raw|toctree|cmake-module|automodule|"
    r"autoclass|autofunction|include|index|only|graphviz|digraph)::")


_RST_VERSION_NOTE = re.compile(r"\s*\.\. (versionadded|versionchanged)::.*")
_RST_REFERENCE = re.compile(r"(?<=[A-Za-z0-9])_(?=[\s.,;:!?)]|$)")  # `dvipng_`


def rst_inline(text: str) -> str:
    """`text` with roles, links, literals and emphasis reduced to their text."""
    text = _RST_ROLE.sub(r"\1", text)
    text = _RST_REFERENCE.sub("", _RST_LINK.sub(r"\1", text))
    return _RST_MARKUP.sub(lambda m: next(g for g in m.groups() if g is not None), text)


def rst_text(source: str) -> str:
    """The prose of a reStructuredText document, one paragraph per text paragraph.

    Kept: section titles (their under/overlines removed) and text paragraphs, including the
    indented content of prose directives (notes, option and variable descriptions), with lines
    joined and inline markup reduced to its text. Dropped: literal blocks (after `::`), the
    content of code, table, image and toctree directives, directive and comment lines
    themselves, version notes (`.. versionadded:: 3.2`), link targets, and paragraphs that
    are tables.
    """
    out, skip_indent = [], None  # skip paragraphs indented deeper than this (a code block)
    for para in _POD_PARAGRAPH_BREAK.split(source.replace("\r\n", "\n")):
        if not para.strip():
            continue
        indent = len(para) - len(para.lstrip(" "))
        if skip_indent is not None:
            if indent > skip_indent:
                continue
            skip_indent = None
        lines = [ln for ln in para.strip("\n").split("\n")
                 if not (_RST_UNDERLINE.fullmatch(ln.strip()) or _RST_VERSION_NOTE.fullmatch(ln))]
        first = lines[0].strip() if lines else ""
        if first.startswith(".. "):
            if _RST_CODE_DIRECTIVES.match(first) or not re.match(r"\.\. [\w:-]+::", first):
                skip_indent = indent  # code, tables, comments, link targets: with their content
                continue
            lines = [re.sub(r"^\.\. [\w:-]+::\s*", "", first)] + lines[1:]
            lines = [ln for ln in lines if not re.match(r"\s*:[\w-]+:(\s|$)", ln)]  # options
        if not lines or first.startswith(("+-", "|", "==", ">>>")):
            continue
        line = " ".join(" ".join(lines).split())
        if line.endswith("::"):  # a literal block follows
            line = line[:-2].rstrip() + (":" if line[:-2].rstrip() else "")
            skip_indent = indent
        line = rst_inline(line)
        if line:
            out.append(line)
    return join_paragraphs(out)


# --- the tagged Brown corpus ----------------------------------------------------------------
_BROWN_QUOTES = {"``": '"', "''": '"'}
_NO_SPACE_BEFORE = {",", ".", ";", ":", "?", "!", ")", "]", "''"}
_NO_SPACE_AFTER = {"(", "[", "``"}
_REPEATED = {",", ";", ":", "?", "!"}


def brown_sentence(tokens: list[str]) -> str:
    """Readable text of Brown `word/tag` tokens: tags removed, punctuation attached.

    The tag is what follows the last `/` (`1/2/cd` is the word `1/2`). Brown writes double quotes
    as `` and '' and single quotes as ' both ways; single quotes alternate open/close within the
    token list.
    """
    words = [t.rsplit("/", 1)[0] if "/" in t[1:] else t for t in tokens]
    out, attach, single_open = [], True, False
    for i, w in enumerate(words):
        previous = words[i - 1] if i else ""
        if (w == "." and previous.endswith(".")) or (w in _REPEATED and previous == w):
            continue  # "Jr. ." ends with one period; this copy of Brown writes each ; ? ! twice
        closing = w in _NO_SPACE_BEFORE
        if w == "'":
            closing = single_open
            single_open = not single_open
        if out and not attach and not closing:
            out.append(" ")
        out.append(_BROWN_QUOTES.get(w, w))
        attach = w in _NO_SPACE_AFTER or (w == "'" and single_open)
    return "".join(out)


def _brown_headline(line: list[str]) -> bool:
    return all(re.search(r"/[^/]*-hl$", t) for t in line)


def brown_text(tagged: str) -> str:
    """A Brown corpus sample as prose: one paragraph per blank-line-separated block of
    sentence lines, except that a headline line (every tag `-hl`) is a paragraph of its own."""
    paras = []
    for block in re.split(r"\n\s*\n", tagged):
        tokens = []
        for line in block.split("\n"):
            line = line.split()
            if line and _brown_headline(line):
                paras += [brown_sentence(tokens), brown_sentence(line)]
                tokens = []
            else:
                tokens += line
        paras.append(brown_sentence(tokens))
    return join_paragraphs([p for p in paras if p])
