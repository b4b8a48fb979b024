"""pagefleet.dev: tools for people, not for pods.

``pagefleet up`` (a local fleet), ``pagefleet bench`` (load generator and report),
``pagefleet generate`` (the engine alone), the embedded Redis server and the GPU compile
check. No runtime package (engine, daemon, gateway, operator) imports from here; the
layering contract in pyproject.toml enforces it.
"""
