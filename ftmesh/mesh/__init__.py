"""The mesh: membership, the data plane and state joined into one member of a training mesh.

``core`` holds the async ``Mesh`` (trio), ``blocking`` the blocking face ``SyncMesh`` that
runs the mesh in a thread of its own, ``meta`` the member metadata every member publishes,
``reach`` the reachability driver, ``gpu`` the GPU collectives. Import from the submodules;
this package face stays empty so that importing one part does not load the others.
"""
