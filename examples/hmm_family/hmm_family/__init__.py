"""taskgeom's worked example of a plugin family: a mixture of hidden Markov models, registered
through the entry-point group ``taskgeom.families`` as ``hmm``."""

from hmm_family.family import HMM, HMMSettings

__all__ = ["HMM", "HMMSettings"]
