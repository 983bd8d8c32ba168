# rayfed_dg from Python (a notebook cell): the quickstart's FedAvg on the colour target, on a tiny budget.
# Same run, same numbers as:  rayfed-dg run configs/quickstart.yaml --target colour --set compare=null
#                               --set training.rounds=2 --set data.resolution=16 --set model.width=8
import rayfed_dg

result = rayfed_dg.run(
    "configs/quickstart.yaml",
    {"compare": None, "training.rounds": 2, "data.resolution": 16, "model.width": 8},  # --set values
    target="colour",
)
print(result.run_dir)  # runs/quickstart-<time>: rayfed-dg report / plot / run --resume read it
print(result.table())  # the table `rayfed-dg report RUN_DIR` prints, in Markdown
m = result.metrics  # a DataFrame: label, seed, then metrics.parquet's columns
print(m[m.split == "target_test"][["label", "round", "accuracy"]])
