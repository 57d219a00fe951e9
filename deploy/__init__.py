"""Deployment tooling that runs without a cluster: render the kustomize overlays (``deploy.kustomize``),
read what the rendered manifests tell each pod (``deploy.manifests``), and run the RayService's Serve
config on a real multi-node Ray cluster on one machine (``python -m deploy.multinode``).

Not part of the served package (``pip install .`` leaves it out): it is imported from the repository
root, by the tests and by ``python -m``.
"""
