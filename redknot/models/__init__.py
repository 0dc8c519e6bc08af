"""Model families, one folder each, behind one seam.

:mod:`redknot.models.registry` names every family (its ``model.family`` value, the
``architectures`` / ``model_type`` of the checkpoints it loads, its module) and finds
a config's family; :mod:`redknot.models.family` is the interface a family implements.
The engine side imports only these two; a family's folder holds its math, state,
checkpoint I/O and tokenizer. Adding a family: a folder with a ``family.py`` defining
``FAMILY``, and one registry entry.
"""
