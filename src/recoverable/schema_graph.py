"""Which parts of a JSON schema have a finite instance, and a well-founded way to build one.

A schema is read as an AND/OR graph: a subschema needs its ``$ref`` target, every
``allOf`` part, one ``anyOf``/``oneOf`` branch and one allowed ``type``; an object type
needs every *required* property that ``properties`` declares, an array type needs its
``items`` when ``minItems`` > 0. ``const``, a non-empty ``enum`` and scalar types are
leaves. A least fixed point (Horn-clause propagation, linear in the schema size) marks
the nodes that have a finite instance; the order in which nodes were marked is
well-founded, so following only earlier-marked children always terminates.

The analysis over-approximates (keywords such as ``not``, ``if``, numeric bounds and
``pattern`` are not modelled): a node marked *uninhabited* really has no finite JSON
instance, which is what ``contract_for`` refuses; a node marked inhabited may still be
unsatisfiable for other reasons (answer synthesis checks its own result).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["SchemaGraph", "json_pointer", "resolve_pointer"]

_SCALAR_TYPES = ("string", "integer", "number", "boolean", "null")
_ALL_TYPES = ("object", "array", *_SCALAR_TYPES)
_AND, _OR = 0, 1


def resolve_pointer(root: Any, ref: str) -> Any:
    """The value a local ``$ref`` (``#`` or ``#/a/b``) points at, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    target: Any = root
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def json_pointer(path: tuple[str | int, ...]) -> str:
    """The ``#/...`` pointer (escaped) of a path of keys and indexes in a schema."""
    parts = (str(part).replace("~", "~0").replace("/", "~1") for part in path)
    return "#/" + "/".join(parts) if path else "#"


def type_names(schema: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``type`` keyword as a tuple of names (every type when absent or unreadable)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return (kind,)
    if isinstance(kind, list) and kind and all(isinstance(name, str) for name in kind):
        return tuple(kind)
    return _ALL_TYPES


def min_items(schema: Mapping[str, Any]) -> int:
    count = schema.get("minItems", 0)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


def required_names(schema: Mapping[str, Any]) -> list[str]:
    required = schema.get("required")
    if not isinstance(required, list):
        return []
    return [name for name in required if isinstance(name, str)]


class SchemaGraph:
    """The AND/OR graph of one root schema; ``order`` of a schema is None when uninhabited.

    Schema nodes are keyed by object identity: query it with subschemas of the root it
    was built from.
    """

    def __init__(self, root: Any) -> None:
        self.root = root
        self._kind: list[int] = []
        self._children: list[list[int]] = []
        self._schema_node: dict[int, int] = {}  # id(schema dict) -> node
        self._paths: dict[int, tuple[str | int, ...]] = {}  # id(schema dict) -> first path
        self._keep: list[Any] = []  # schema dicts referenced by id, kept alive
        self._false_paths: dict[int, tuple[str | int, ...]] = {}
        self._true_leaf = self._new(_AND, [])
        self._false_leaf = self._new(_OR, [])
        self._build()
        self._schema_nodes = {node: key for key, node in self._schema_node.items()}
        self._order: list[int | None] = self._propagate()

    # -- construction ---------------------------------------------------------------
    def _new(self, kind: int, children: list[int]) -> int:
        self._kind.append(kind)
        self._children.append(children)
        return len(self._kind) - 1

    def _node_for(self, schema: Any, path: tuple[str | int, ...], todo: deque[Any]) -> int:
        if schema is True:
            return self._true_leaf
        if schema is False:
            leaf = self._new(_OR, [])  # one per occurrence, so a message can name it
            self._false_paths[leaf] = path
            return leaf
        if not isinstance(schema, dict):
            return self._true_leaf  # not a schema: left to the JSON Schema compiler
        key = id(schema)
        node = self._schema_node.get(key)
        if node is None:
            node = self._new(_AND, [])
            self._schema_node[key] = node
            self._paths[key] = path
            self._keep.append(schema)
            todo.append((schema, path, node))
        return node

    def _build(self) -> None:
        todo: deque[Any] = deque()
        self._node_for(self.root, (), todo)
        while todo:
            schema, path, node = todo.popleft()
            self._children[node] = self._requirements(schema, path, todo)

    def _requirements(
        self, schema: dict[str, Any], path: tuple[str | int, ...], todo: deque[Any]
    ) -> list[int]:
        def sub(value: Any, *where: str | int) -> int:
            return self._node_for(value, (*path, *where), todo)

        # Sub-schemas in keyword positions are visited even when they do not decide
        # inhabitation (``$defs``, optional properties), so every node has an order.
        for name, value in _other_subschemas(schema):
            sub(value, *name)
        if "const" in schema:
            return []
        enum = schema.get("enum")
        if isinstance(enum, list):
            return [] if enum else [self._false_leaf]
        needs: list[int] = []
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = resolve_pointer(self.root, ref)
            if target is not None:
                needs.append(self._node_for(target, _path_of_ref(ref), todo))
        all_of = schema.get("allOf")
        if isinstance(all_of, list):
            needs.extend(sub(part, "allOf", index) for index, part in enumerate(all_of))
        for keyword in ("anyOf", "oneOf"):
            branches = schema.get(keyword)
            if isinstance(branches, list):
                options = [sub(branch, keyword, index) for index, branch in enumerate(branches)]
                needs.append(self._new(_OR, options))
        alternatives: list[int] = []
        for kind in type_names(schema):
            if kind == "object":
                props = schema.get("properties")
                props = props if isinstance(props, dict) else {}
                alternatives.append(self._new(_AND, [
                    sub(props[name], "properties", name)
                    for name in required_names(schema) if name in props
                ]))
            elif kind == "array":
                alternatives.append(self._new(_AND, self._array_needs(schema, sub)))
            else:
                alternatives.append(self._true_leaf)
        needs.append(self._new(_OR, alternatives))
        return needs

    @staticmethod
    def _array_needs(schema: Mapping[str, Any], sub: Any) -> list[int]:
        count = min_items(schema)
        if count == 0:
            return []
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        needs = [sub(part, "prefixItems", index) for index, part in enumerate(prefix[:count])]
        if count > len(prefix) and "items" in schema and not isinstance(schema["items"], list):
            needs.append(sub(schema["items"], "items"))
        return needs

    def _propagate(self) -> list[int | None]:
        count = len(self._kind)
        parents: list[list[int]] = [[] for _ in range(count)]
        missing = [0] * count
        ready: deque[int] = deque()
        for node in range(count):
            children = self._children[node]
            for child in children:
                parents[child].append(node)
            if self._kind[node] == _AND:
                missing[node] = len(children)
                if not children:
                    ready.append(node)
        order: list[int | None] = [None] * count
        step = 0
        while ready:
            node = ready.popleft()
            if order[node] is not None:
                continue
            order[node] = step
            step += 1
            for parent in parents[node]:
                if order[parent] is not None:
                    continue
                if self._kind[parent] == _OR:
                    ready.append(parent)
                else:
                    missing[parent] -= 1
                    if missing[parent] == 0:
                        ready.append(parent)
        return order

    # -- queries --------------------------------------------------------------------
    def order(self, schema: Any) -> int | None:
        """When ``schema`` was found inhabited (smaller is simpler); None: no finite instance."""
        if schema is True or not isinstance(schema, dict):
            return -1
        if schema is False:
            return None
        node = self._schema_node.get(id(schema))
        return None if node is None else self._order[node]

    def path(self, schema: Any) -> str:
        return json_pointer(self._paths.get(id(schema), ()))

    def no_finite_instance(self) -> str | None:
        """None when the root has a finite instance; else why not, naming a JSON pointer."""
        if self.order(self.root) is not None:
            return None
        seen: list[int] = []
        via_property: set[int] = set()
        node = self._schema_node[id(self.root)]
        came_by_property = False
        while True:
            if node in seen:
                cycle = seen[seen.index(node):]
                entry = next((step for step in cycle if step in via_property), cycle[0])
                return (
                    f"the schema has no finite instance: the required value at "
                    f"{self._node_path(entry)} can only be satisfied by recursing into itself "
                    "with no way out; give the recursion an exit (a nullable or anyOf branch "
                    "without the cycle, or an array that may be empty)"
                )
            if self._is_schema(node):
                seen.append(node)
                if came_by_property:
                    via_property.add(node)
            child, came_by_property = self._blocking_child(node)
            if child is None:
                if node in self._false_paths:
                    where = json_pointer(self._false_paths[node])
                else:
                    where = self._node_path(seen[-1]) if seen else "#"
                return (
                    f"the schema has no finite instance: no value can satisfy the subschema at "
                    f"{where} (a false schema, an empty enum or anyOf, or required values "
                    "that cannot exist)"
                )
            node = child

    def _is_schema(self, node: int) -> bool:
        return node in self._schema_nodes

    def _node_path(self, node: int) -> str:
        key = self._schema_nodes.get(node)
        return json_pointer(self._paths[key]) if key is not None else "#"

    def _blocking_child(self, node: int) -> tuple[int | None, bool]:
        """A child that keeps ``node`` uninhabited (and whether it is a required property)."""
        children = self._children[node]
        uninhabited = [child for child in children if self._order[child] is None]
        if not uninhabited:
            return None, False
        if self._kind[node] == _OR:
            # Every branch fails: follow the first that is itself a schema, else the first.
            for child in uninhabited:
                if self._is_schema(child) or self._children[child] or (
                    child in self._false_paths
                ):
                    return child, self._is_property_alternative(node)
            return None, False
        return uninhabited[0], self._is_property_alternative(node)

    def _is_property_alternative(self, node: int) -> bool:
        # Object alternatives are AND nodes whose children are property schemas; the
        # flag only decides which node of a cycle the message names, so a heuristic is
        # enough: an AND node that is not itself a schema node.
        return self._kind[node] == _AND and not self._is_schema(node)


def _path_of_ref(ref: str) -> tuple[str | int, ...]:
    if ref in ("#", "#/"):
        return ()
    return tuple(raw.replace("~1", "/").replace("~0", "~") for raw in ref[2:].split("/"))


_MAP_KEYWORDS = frozenset(
    {"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"}
)
_ONE_KEYWORDS = frozenset({
    "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
    "unevaluatedItems", "unevaluatedProperties", "additionalItems", "contentSchema", "items",
})
_LIST_KEYWORDS = frozenset({"prefixItems", "items"})


def _other_subschemas(schema: dict[str, Any]) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    for keyword, value in schema.items():
        if keyword in _MAP_KEYWORDS:
            if isinstance(value, dict):
                for name, sub in value.items():
                    yield (keyword, name), sub
        elif keyword in _ONE_KEYWORDS or keyword in _LIST_KEYWORDS:
            if isinstance(value, dict | bool):
                yield (keyword,), value
            elif isinstance(value, list) and keyword in _LIST_KEYWORDS:
                for index, sub in enumerate(value):
                    yield (keyword, index), sub
