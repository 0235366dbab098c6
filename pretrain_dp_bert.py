"""BERT sequence classification, data parallelism (dp_deg = world unless the config says; DDP over replicas). See README.md; run with --help for the arguments."""
from galaxy.launch import main
from galaxy.train.trainer import prepare_classifier, train

if __name__ == "__main__":
    main(preset="dp", prepare_fn=prepare_classifier, train_fn=train, script="pretrain_dp_bert.py",
         default_config="train_config/bert/dp/full.json", model_type="bert")
