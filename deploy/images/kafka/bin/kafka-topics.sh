#!/bin/sh
# apache/kafka's topics tool (the Compose file's health check runs it).
exec java -Xmx256m -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.yaml \
  -cp '/opt/kafka/libs/*' org.apache.kafka.tools.TopicCommand "$@"
