# The node image for cluster.yaml: Ray's own 2.60.0 GPU image with this project and its dependencies installed,
# so that a node starts without a pip install (torch 2.14.1 and its CUDA libraries are most of that time).
#
#   docker build -t <registry>/rayfed-dg:0.1.0 . && docker push <registry>/rayfed-dg:0.1.0
#
# then name it in cluster.yaml's docker.image (the commented line there); docs/clusters.md says more.  Rebuild
# when pyproject.toml's dependencies change: the code itself comes from the working tree `ray up` syncs.
FROM rayproject/ray:2.60.0-py311-gpu

# pyproject.toml's dependencies, with Ray held at the image's 2.60.0 (every node must run the head's Ray); in
# a layer of their own, so that a change to the code rebuilds only the small layers below
RUN pip install --no-cache-dir \
      "ray[tune]==2.60.0" \
      "torch==2.14.1" \
      "torchvision==0.29.1" \
      "numpy>=1.26" \
      "pyarrow>=16" \
      "pyyaml>=6" \
      "scikit-learn>=1.3" \
      "pydantic>=2.5" \
      "tqdm>=4.66" \
      "matplotlib>=3.8" \
      "psutil>=5.9" \
      "tensorboardX>=2.6" \
      "tensorboard>=2.14" \
      "dp-accounting>=0.6,<0.7"

# where cluster.yaml's file_mounts put the working tree in the container (~/rayfed_dg, the image user's home):
# `ray up` mounts the synced tree over this copy and the editable install runs that code; without a mount
# (docker run), this copy
WORKDIR /home/ray/rayfed_dg
COPY --chown=ray:users . .
RUN pip install --no-cache-dir --no-deps -e .
