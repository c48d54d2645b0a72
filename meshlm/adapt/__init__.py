"""Adapting trained models into new shapes: upcycling a dense model into a Mixture of Experts
(upcycle.py, ``meshlm upcycle``)."""
