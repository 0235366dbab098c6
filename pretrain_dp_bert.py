"""BERT sequence classification, data parallelism (dp_deg = world unless the config says; DDP over replicas). --predict FILE classifies instead of training. See README.md; run with --help for the arguments."""
from galaxy.launch import main
from galaxy.inference.predict import add_predict_arguments, prepare_classify, run_classify

if __name__ == "__main__":
    main(preset="dp", prepare_fn=prepare_classify, train_fn=run_classify,
         add_arguments=add_predict_arguments, script="pretrain_dp_bert.py",
         default_config="train_config/bert/dp/full.json", model_type="bert")
