"""Constrained decoding: replies held to a JSON Schema (structured outputs, forced tool calls).

``json_schema.py`` reads a schema into grammar nodes, ``json_recognizer.py`` reads a document
against them byte by byte, ``vocabulary.py`` turns a recognizer state into the tokens allowed
next, ``grammar.py`` remembers those masks, and ``token_constraint.py`` follows one reply.
"""
