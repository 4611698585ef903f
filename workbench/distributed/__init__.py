"""The distributed layer: tensor-parallel runs over several processes (the paper's 2.3).

    comm      collectives behind one interface (all_reduce_, broadcast_, all_gather):
              gloo (torch.distributed) and shm (our shared-memory kernels)
    shard     how a model's weights split over ranks (taken as they load)
    tp        TensorParallel, the rank's part given to load_model: the all-reduces, the
              distributed embedding and LM head, the three switches
    engine    what each ipyparallel engine (one per rank) runs
    cluster   Cluster (starts the engines) and DistributedModel (the Model API over them)
"""
