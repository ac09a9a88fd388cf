"""Data: what a run reads, and the one loader contract it reads it through.

read.py picks the reader for a config (tabular.py, cifar10.py, folder.py, or shards through stream.py) and whether
the data is streamed (placement.py). Held in memory, a data set is a Dataset (dataset.py) served by loader.py;
streamed, shards (shards.py: tar members; sample_stream.py: one process's samples and its exact position) are
served by stream.py. Both loaders keep the contract of batches.py and share augment.py; decode.py decodes images
for streams, files.py reads what a URL holds, pack.py packs folders into shards.
"""
