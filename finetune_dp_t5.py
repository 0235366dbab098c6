"""T5 sequence-to-sequence fine-tuning, data parallelism (dp_deg = world unless the config says;
DDP over replicas, or FSDP2 with dp_sharding).

See README.md (docs/models.md); run with --help for the arguments.
"""
from galaxy.launch import main
from galaxy.train.trainer import prepare_seq2seq, train

if __name__ == "__main__":
    main(preset="dp", prepare_fn=prepare_seq2seq, train_fn=train, script="finetune_dp_t5.py",
         default_config="train_config/t5/dp/full.json", model_type="t5")
