"""Rank placement (workbench.hw.topology) on synthetic machines and on this one, the sysfs
reader on a fake sysfs tree, and the memory binding in a real process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workbench.hw.topology import Node, Topology, place_ranks, read_topology


def machine(sockets: list[list[int]], smt: int = 1) -> Topology:
    """sockets[s] = the core counts of socket s's NUMA nodes (SNC domains); CPUs numbered
    core by core, SMT siblings at cpu + total cores (as Linux numbers them)."""
    total = sum(map(sum, sockets))
    nodes, core = [], 0
    for package, node_cores in enumerate(sockets):
        for count in node_cores:
            cores = tuple(tuple(c + k * total for k in range(smt)) for c in range(core, core + count))
            nodes.append(Node(len(nodes), package, cores))
            core += count
    return Topology(tuple(nodes))


def check_disjoint_and_inside(topo: Topology, plan) -> None:
    seen = [c for p in plan for c in p.cpus]
    assert len(seen) == len(set(seen)), plan
    for p in plan:
        assert set(p.cpus) <= set(next(n for n in topo.nodes if n.id == p.node).cpus), p


def test_two_sockets_with_two_snc_nodes_each():
    topo = machine([[4, 4], [4, 4]], smt=2)  # nodes 0, 1 on socket 0; 2, 3 on socket 1
    two = place_ranks(topo, 2, 2)
    assert [p.node for p in two] == [0, 2]  # one rank per socket before a second node of one
    assert two[0].cpus == [0, 1] and two[1].cpus == [8, 9]  # whole cores, no SMT sibling
    four = place_ranks(topo, 4, 4)
    assert [p.node for p in four] == [0, 2, 1, 3]  # one rank per SNC node
    assert all(len({c % 16 for c in p.cpus}) == 4 for p in four)  # four distinct physical cores each
    check_disjoint_and_inside(topo, four)
    eight = place_ranks(topo, 8, 2)
    assert [p.node for p in eight] == [0, 2, 1, 3, 0, 2, 1, 3]
    check_disjoint_and_inside(topo, eight)


def test_odd_core_counts_and_smt_siblings_last():
    topo = machine([[3, 5]], smt=1)
    assert [(p.node, p.cpus) for p in place_ranks(topo, 2, 3)] == [(0, [0, 1, 2]), (1, [3, 4, 5])]
    with pytest.raises(ValueError, match="NUMA node 0 has 3 CPUs .* 2 rank\\(s\\) x 2 thread\\(s\\) = 4"):
        place_ranks(topo, 4, 2)  # ranks 0 and 2 both land on node 0
    smt = machine([[3, 5]], smt=2)  # node 0: cores 0-2 with siblings 8-10
    plan = place_ranks(smt, 4, 2)
    assert plan[0].cpus == [0, 1] and plan[2].cpus == [2, 8]  # every core once, then a sibling
    check_disjoint_and_inside(smt, plan)


def test_bad_counts_name_the_argument():
    topo = machine([[2]])
    for kwargs, name in (({"ranks": 0, "threads_per_rank": 1}, "ranks"), ({"ranks": 1, "threads_per_rank": 1.5},
                                                                          "threads_per_rank")):
        with pytest.raises(ValueError, match=name):
            place_ranks(topo, **kwargs)


def test_sysfs_reader_on_a_fake_tree(tmp_path):
    """Two nodes of one socket (SNC), four cores with SMT siblings 4-7; this process may use
    all but CPU 3."""
    for n, cpus in ((0, "0-1,4-5"), (1, "2-3,6-7")):
        (tmp_path / "node" / f"node{n}").mkdir(parents=True)
        (tmp_path / "node" / f"node{n}" / "cpulist").write_text(cpus + "\n")
    for cpu in range(8):
        d = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text("0\n")
        (d / "core_id").write_text(f"{cpu % 4}\n")
    topo = read_topology(tmp_path, allowed={0, 1, 2, 4, 5, 6, 7})
    assert [(n.id, n.package, n.cores) for n in topo.nodes] == [(0, 0, ((0, 4), (1, 5))), (1, 0, ((2, 6), (7,)))]
    assert [(p.node, p.cpus) for p in place_ranks(topo, 2, 2)] == [(0, [0, 1]), (1, [2, 7])]


def test_this_machine_and_a_real_memory_binding():
    import os

    topo = read_topology()
    assert sorted(c for n in topo.nodes for c in n.cpus) == sorted(os.sched_getaffinity(0))
    node = topo.nodes[0].id
    code = ("from workbench.hw.topology import bind_memory, memory_policy; "
            f"before = memory_policy(); bind_memory([{node}]); print(before, memory_policy())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"('default', []) ('bind', [{node}])"
