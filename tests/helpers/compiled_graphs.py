"""What a test reads off the graphs ``torch.compile`` traces: a backend that keeps them, and the
check that no custom autograd Function traced into them returns another node's tensor."""

from __future__ import annotations


class GraphCounter:
    """A torch.compile backend that keeps each graph Dynamo hands it and runs it as traced (no Inductor)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(graph_module)
        return graph_module.forward


def returned_tensors_aliasing_intermediates(graph_module) -> list[str]:
    """Each tensor an autograd Function traced into ``graph_module`` returns that is the same tensor
    object as another node of its forward graph (an in-place op's result, a no-op ``.contiguous()``
    or ``.to()``): on torch 2.11 such an output gets no gradient under torch.compile
    (meshlm/models/function_outputs.py). Read off the traced graphs, so it holds on any torch."""
    found = []
    for name, body in list(graph_module.named_modules()):
        if not name.rpartition(".")[2].startswith("fwd_body"):
            continue
        output = next(node for node in body.graph.nodes if node.op == "output")
        returned = output.args[0][0] if isinstance(output.args[0][0], (tuple, list)) else (output.args[0][0],)
        # torch 2.11 returns every intermediate after the Function's own outputs, which its backward
        # graph takes as placeholders named unused_*: only the outputs before them are the Function's
        parent, _, own = name.rpartition(".")
        backward = graph_module.get_submodule(".".join(filter(None, (parent, own.replace("fwd_body", "bwd_body")))))
        unused = sum(node.op == "placeholder" and node.name.startswith("unused_") for node in backward.graph.nodes)
        for node in returned[:len(returned) - unused]:
            value = node.meta.get("example_value") if hasattr(node, "meta") else None
            if value is None:
                continue
            found += [f"{name}: {node.name} is {other.name} ({(node.stack_trace or '').strip().splitlines()[-2:]})"
                      for other in body.graph.nodes
                      if other is not node and other.op != "output" and other.meta.get("example_value") is value]
    return found
