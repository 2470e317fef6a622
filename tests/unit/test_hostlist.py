"""Unit tests of the Slurm hostlist parser (mpijax/_src/cluster/hostlist.py)."""

from __future__ import annotations

import pytest

from mpijax._src.cluster.hostlist import expand_hostlist


@pytest.mark.parametrize("text,expected", [
    ("node[001-004,007],gpu-[1-2]a",
     ("node001", "node002", "node003", "node004", "node007", "gpu-1a", "gpu-2a")),
    # Zero padding follows the width of the range's low end.
    ("n[08-10]", ("n08", "n09", "n10")),
    ("n[8-10]", ("n8", "n9", "n10")),
    ("n[098-100]", ("n098", "n099", "n100")),
    ("n[007]", ("n007",)),
    # Several bracket groups: cartesian product, leftmost group slowest.
    ("rack[1-2]-node[01-02]", ("rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02")),
    ("[1-2]x[3,5]", ("1x3", "1x5", "2x3", "2x5")),
    # Commas inside brackets list numbers; commas outside separate hosts.
    ("a[1,3],b[2],c", ("a1", "a3", "b2", "c")),
    ("n[1-2,5-6]", ("n1", "n2", "n5", "n6")),
    # Plain names, including dots and dashes.
    ("login1", ("login1",)),
    ("node-1.cluster.org,node-2.cluster.org", ("node-1.cluster.org", "node-2.cluster.org")),
    ("a, b", ("a", "b")),
    ("", ()),
    ("   ", ()),
    # Order is kept as written, like Slurm's hostlist_create (no sorting).
    ("z1,a[3,1]", ("z1", "a3", "a1")),
])
def test_expand(text, expected):
  assert expand_hostlist(text) == expected


def test_big_range():
  hosts = expand_hostlist("c[0000-1023]")
  assert len(hosts) == 1024 and hosts[0] == "c0000" and hosts[-1] == "c1023"


@pytest.mark.parametrize("text,why", [
    ("node[1-2", "'\\[' without '\\]'"),
    ("node1-2]", "'\\]' without '\\['"),
    ("node[[1-2]]", "nested"),
    ("node[5-3]", "'5-3' .* runs backwards"),
    ("node[a-c]", "'a-c'.* not a number"),
    ("node[1-c]", "'1-c'.* not a number"),
    ("node[]", "''.*not a number"),
    ("node[1-]", "'1-'"),
    ("node[-1]", "'-1'"),
    ("node[1,,2]", "''"),
    ("a,,b", "empty host name"),
    ("a,", "empty host name"),
    (",a", "empty host name"),
    ("a b", "white space"),
    ("n[1-99999999]", "more than"),
])
def test_malformed(text, why):
  with pytest.raises(ValueError, match="malformed Slurm hostlist") as err:
    expand_hostlist(text)
  assert repr(text) in str(err.value)
  assert err.match(why)
