"""The recipes' own studies, one package each (``e2``, ``e4``): the experiment a recipe's ``study``
section names beside the generic ones, with its claims, its measurements and its figures; each
package's ``EXPERIMENT`` is registered (``claims.registry``)."""
